"""Configuration errors name the field and the allowed values; the strategy names exist after import."""

from __future__ import annotations

import dataclasses
import re
import warnings

import lightning.pytorch as pl

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import StrategyRegistry

import lightning_zero
from lightning_zero import ZeroConfig, ZeroConfigError, ZeroStrategy
from lightning_zero.config import Stage3Config
from lightning_zero.precision import ZeroPrecision


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"stage": 5}, "stage=5 is invalid: allowed values are 1, 2 or 3"),
        ({"stage": 0}, "stage=0 is invalid"),
        ({"stage": True}, "stage=True is invalid"),
        ({"bucket_mb": 0}, "bucket_mb=0 is invalid: it must be a number of MiB > 0"),
        ({"bucket_mb": -1.5}, "bucket_mb=-1.5 is invalid"),
        ({"bucket_mb": "big"}, "bucket_mb='big' is invalid"),
        ({"unit_mb": 0.0}, "unit_mb=0.0 is invalid: it must be a number of MiB > 0"),
        ({"prefetch": 0}, "prefetch=0 is invalid: it must be an integer >= 1"),
        ({"prefetch": 1.5}, "prefetch=1.5 is invalid"),
        ({"units": "Block"}, "units='Block' is invalid: it must be a list of module class names or module paths"),
        ({"units": ("Block", 3)}, "units=('Block', 3) is invalid"),
        ({"reshard_after_forward": "yes"}, "reshard_after_forward='yes' is invalid: it must be true or false"),
        ({"shard_group_size": "auto"}, "shard_group_size='auto' is invalid: it must be an integer >= 1 that divides the "
                                       "world size, 'node' (one group per node, as the launcher laid them out), or null"),
        ({"node_size": "node"}, "node_size='node' is invalid: it must be an integer >= 1 that divides the world size, "
                                "or null"),
        ({"stage": 3, "shard_group_size": "node", "hpz_group_size": "node"},
         "hpz_group_size='node' is invalid with shard_group_size='node': hpZ's group must be smaller than the shard "
         "group, which is the node"),
    ],
)
def test_invalid_values_name_the_field(kwargs, message) -> None:
    with pytest.raises(ZeroConfigError, match=re.escape(message)):
        ZeroConfig.from_options(**kwargs)


def test_groups_of_one_node_are_named() -> None:
    config = ZeroConfig.from_options(stage=3, shard_group_size="node", hpz_group_size=2)
    assert (config.topology.shard_group_size, config.topology.hpz_group_size) == ("node", 2)
    assert ZeroConfig.from_options(stage=3, hpz_group_size="node").topology.hpz_group_size == "node"


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        ZeroConfig().stage = 1  # type: ignore[misc]


def test_names_are_registered_on_import() -> None:
    names = set(StrategyRegistry)
    for stage in (1, 2, 3):
        for suffix in ("", "_fork", "_spawn", "_notebook"):
            assert f"zero{stage}{suffix}" in names
    assert StrategyRegistry["zero1_fork"]["init_params"] == {"stage": 1, "start_method": "fork"}
    assert lightning_zero.ZeroStrategy is ZeroStrategy


@pytest.mark.parametrize("name", ["zero1", "zero2_fork", "zero3", "zero3_notebook"])
def test_trainer_builds_the_strategy_from_its_name(name: str) -> None:
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy)
    assert trainer.strategy.config.stage == int(name[4])


@pytest.mark.parametrize("flag", ["bf16-true", "16-true", "64-true"])
def test_unsupported_precision_is_refused_naming_the_allowed_ones(flag: str) -> None:
    with pytest.raises(ValueError, match=f"precision='{flag}' is not supported by ZeroStrategy: allowed values are "
                       "'32-true', 'bf16-mixed', '16-mixed'"):
        pl.Trainer(strategy="zero2", accelerator="cpu", devices=1, precision=flag, logger=False)


@pytest.mark.parametrize("flag,expected", [("32-true", "32-true"), ("bf16-mixed", "bf16-mixed")])
def test_the_precision_flag_is_honoured(flag: str, expected: str) -> None:
    for strategy in ("zero3", ZeroStrategy(stage=1)):
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, precision=flag, logger=False)
        assert isinstance(trainer.strategy.precision_plugin, ZeroPrecision)
        assert trainer.strategy.precision_plugin.precision == expected


def test_fp16_mixed_gets_sharded_loss_scaling() -> None:
    # On CPU Lightning turns precision="16-mixed" into bf16, so the fp16 plugin (as on CUDA) is passed explicitly.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    strategy = ZeroStrategy(stage=2, precision_plugin=plugin)
    assert strategy.precision_plugin.precision == "16-mixed"
    assert strategy.precision_plugin.scaler is not None and strategy.precision_plugin.scaler.get_scale() == 2.0**16


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch disables a CUDA GradScaler only where there is no CUDA")
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_fp16_on_a_mocked_gpu_keeps_lightnings_disabled_scaler_as_ddp_does(monkeypatch, strategy: str) -> None:
    # Lightning's test_amp_ddp: 2 GPUs mocked where there is no CUDA. Lightning builds MixedPrecision("16-mixed",
    # "cuda") with GradScaler("cuda"), which torch disables (no _growth_factor then); ZeroStrategy used to read
    # its growth factor to copy it, failing with AttributeError. Now it keeps the plugin's scaler, as DDP does.
    import lightning.fabric.accelerators.cuda as fabric_cuda
    import lightning.pytorch.accelerators.cuda as pytorch_cuda

    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 2)
    monkeypatch.setattr(pytorch_cuda, "num_cuda_devices", lambda: 2)
    with pytest.warns(UserWarning, match="CUDA is not available"):
        trainer = pl.Trainer(fast_dev_run=True, precision="16-mixed", accelerator="gpu", devices=2, strategy=strategy)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed" and plugin.device == "cuda"
    scaler = plugin.scaler
    assert type(scaler) is torch.amp.GradScaler and not scaler.is_enabled()
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"process_group_backend": "bogus"}, "process_group_backend='bogus' is invalid: allowed values are gloo"),
        ({"process_group_backend": "cpu:bogus"}, "process_group_backend='cpu:bogus' is invalid"),
        ({"timeout": 5}, "timeout=5 is invalid: it must be a datetime.timedelta"),
        ({"start_method": "bogus"}, "start_method='bogus' is invalid: allowed values are popen, "),
    ],
)
def test_launch_settings_are_checked_when_the_strategy_is_built(kwargs, message) -> None:
    # Lightning and torch.distributed take these and fail later, on every rank: refused here, before any launch.
    with pytest.raises(ZeroConfigError, match=re.escape(message)):
        ZeroStrategy(stage=2, **kwargs)


def test_composite_backends_and_policy_sets_are_accepted_as_lightning_takes_them() -> None:
    # torch.distributed takes one backend per device type; Lightning's FSDP takes the checkpointing policy as a set.
    assert ZeroStrategy(stage=2, process_group_backend="cpu:gloo")._process_group_backend == "cpu:gloo"
    strategy = ZeroStrategy(stage=3, activation_checkpointing_policy={torch.nn.Linear})
    assert strategy.config.activation_checkpointing_policy == (torch.nn.Linear,)
    with pytest.raises(ZeroConfigError, match="activation_checkpointing_policy"):
        ZeroStrategy(stage=3, activation_checkpointing_policy={torch.nn.Linear, 3})


#: A value away from the default of every option of stage 3 (``Stage3Config``).
STAGE3_VALUES = {"units": ("Block",), "unit_mb": 8.0, "prefetch": 2, "reshard_after_forward": False,
                 "verify_unit_order": False, "buffer_pool_mb": 0, "quantize_weights": True}


def test_every_stage3_option_is_refused_under_stages_1_and_2() -> None:
    """Refused when the strategy is built, one line naming the option, its value and the stage it needs: not warned
    and ignored, as they were (a run would train without what its configuration says)."""
    assert set(STAGE3_VALUES) == {f.name for f in dataclasses.fields(Stage3Config)}
    for stage in (1, 2):
        for name, value in STAGE3_VALUES.items():
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # refused, not warned
                with pytest.raises(ZeroConfigError) as raised:
                    ZeroStrategy(stage=stage, **{name: value})
            message = str(raised.value)
            assert message.startswith(f"{name}={value!r} needs stage=3 (") and message.endswith(f"got stage={stage}")
            assert "\n" not in message
    assert ZeroStrategy(stage=3, **STAGE3_VALUES).config.stage3 == Stage3Config(**STAGE3_VALUES)
    assert ZeroStrategy(stage=2, **{k: getattr(Stage3Config(), k) for k in STAGE3_VALUES}).config.stage == 2


def test_buffer_pool_mb_is_refused_on_cuda_at_setup_before_anything_changes(monkeypatch) -> None:
    """CUDA keeps no buffer pool (its caching allocator reuses freed buffers), so a size given there would be
    ignored: refused once the device is known, first thing in setup, on every rank alike (CUDA faked, as in
    test_launcher_cuda.py)."""
    from tests.unit.test_launcher_cuda import UninitializedCuda

    cuda = UninitializedCuda(monkeypatch)
    trainer = pl.Trainer(strategy=ZeroStrategy(stage=3, buffer_pool_mb=8.0, start_method="fork"), accelerator="cuda",
                         devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    strategy = trainer.strategy
    strategy.model = model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    message = ("buffer_pool_mb=8.0 is invalid on cuda:0: CUDA's caching allocator reuses freed buffers and no pool is "
               "kept there; leave it null (the default) on CUDA")
    with pytest.raises(ZeroConfigError, match=f"^{re.escape(message)}$"):
        strategy.setup(trainer)
    assert strategy._runtime is None and strategy._watchdog is None and not strategy._communicating
    assert all(torch.equal(p, b) and p.device.type == "cpu" for p, b in zip(model.parameters(), before))
    assert cuda.initializing == []


ZEROPP_OPTIONS = [{"hpz_group_size": 2}, {"quantize_weights": True}, {"quantize_grads": "int4"},
                  {"hpz_group_size": 2, "quantize_weights": True, "quantize_grads": "int8"}]
OFFLOAD_OPTIONS = [{"offload_optimizer": "cpu"}, {"offload_optimizer": "cpu", "offload_params": "cpu"},
                   {"offload_optimizer": "disk"}, {"offload_optimizer": "disk", "offload_params": "disk"}]


@pytest.mark.parametrize("zeropp", ZEROPP_OPTIONS)
@pytest.mark.parametrize("offload", OFFLOAD_OPTIONS)
def test_zeropp_options_compose_with_every_offload(zeropp: dict, offload: dict) -> None:
    """hpZ, qwZ and qgZ with each offload are accepted as given (tests/distributed/test_zeropp_offload.py trains
    them); qgZ with zero1/zero2 offload too."""
    config = ZeroConfig.from_options(stage=3, **zeropp, **offload)
    assert {k: config.options()[k] for k in (*zeropp, *offload)} == zeropp | offload
    if "quantize_grads" in zeropp and "offload_params" not in offload:
        for stage in (1, 2):
            assert ZeroConfig.from_options(stage=stage, quantize_grads="int4", **offload).stage == stage


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"stage": 2, "quantize_weights": True, "offload_optimizer": "cpu"},
         "quantize_weights=True needs stage=3 (it quantizes stage 3's parameter all-gathers), got stage=2"),
        ({"stage": 2, "hpz_group_size": 2, "offload_optimizer": "cpu"},
         "hpz_group_size=2 needs stage=3 (it serves stage 3's backward all-gathers), got stage=2"),
        ({"stage": 3, "hpz_group_size": 2, "reshard_after_forward": False, "offload_optimizer": "disk"},
         "hpz_group_size=2 with reshard_after_forward=False has nothing to do: the units stay gathered from forward "
         "to backward; drop one of them"),
        ({"stage": 3, "quantize_grads": "int4", "shard_group_size": 2, "offload_optimizer": "cpu"},
         "quantize_grads='int4' with shard_group_size=2 is not supported: hybrid sharding's traffic across nodes is "
         "the full-precision all-reduce of the shard"),
    ],
)
def test_what_stays_refused_with_offload_is_refused_for_its_own_reason(kwargs, message) -> None:
    """Offload changes none of the ZeRO++ refusals; each stays one line naming its own reason."""
    with pytest.raises(ZeroConfigError, match=re.escape(message)) as raised:
        ZeroConfig.from_options(**kwargs)
    assert "\n" not in str(raised.value) and "offload" not in str(raised.value)
