"""More of what Lightning users do under DDP, under zero1/2/3 (2 ranks, one fork for every case): in-place edits of
weights after steps and ``load_state_dict`` after setup, Lightning's ``grad_norm`` (through ``strategy.grad_norm``),
the model summary, Adagrad and LBFGS, unit names that match nothing, SWA, the fp16 GradScaler,
activation checkpointing, ``torch.compile`` (zero3 included: issue 39), and consolidating a 0-d parameter. DDP is the reference wherever the
feature runs under it; refusals are asserted by their message."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import safetensors.torch
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import grad_norm

from lightning_zero import ZeroStrategy
from lightning_zero.monitor import ZeroMonitor, compile_counts
from lightning_zero.checkpoint import consolidate
from tests.distributed.semantics_models import Clamp, ConvNet
from tests.distributed.test_lightning_semantics import _assert_same_steps, _error, _fit
from tests.harness import run_on_ranks
from tests.models import ParityModel, TinyLM

STAGES = (1, 2, 3)
LR = 1e-2  # ParityModel's AdamW


class LoadAtStart(pl.Callback):
    """``load_state_dict`` of other weights once the strategy is set up (as fine-tuning scripts do)."""

    def on_train_start(self, trainer, pl_module):
        pl.seed_everything(99, verbose=False)
        pl_module.load_state_dict(ParityModel().state_dict())


class GradNorms(pl.Callback):
    def __init__(self) -> None:
        self.norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if isinstance(trainer.strategy, ZeroStrategy):
            self.norms.append(trainer.strategy.grad_norm(2))
        else:
            self.norms.append({k: float(v) for k, v in grad_norm(pl_module, 2).items()})


class SummaryTotal(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        summary = next(c for c in trainer.callbacks if type(c).__name__.endswith("ModelSummary"))
        self.total = summary._summary(trainer, pl_module).total_parameters


def _gathers(strategy, model_fn, world_size) -> tuple[int, int]:
    counter = Calls()
    _fit(strategy, model_fn, world_size, steps=2, callbacks=[counter])
    return counter.calls, counter.block_forwards


class Calls(pl.Callback):
    """All-gathers of the last step, and how many times a transformer block's forward ran in it."""

    def on_train_start(self, trainer, pl_module):
        for module in pl_module.modules():
            if type(module).__name__ == "Block":
                module.register_forward_pre_hook(self._count)

    def _count(self, *_) -> None:
        self.block_forwards += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        trainer.strategy.comm_stats.reset()
        self.block_forwards = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.calls = trainer.strategy.comm_stats.by_op["all_gather"].calls


class CompileCounts(pl.Callback):
    """Frames dynamo has compiled, after every training step."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.counts.append(compile_counts()[0] - self.start)

    def on_fit_start(self, trainer, pl_module):
        torch._dynamo.reset()
        self.start = compile_counts()[0]


def _compiled_in_place() -> ParityModel:
    model = ParityModel()
    model.compile(backend="aot_eager")
    return model


def _block_compiled() -> ParityModel:
    model = ParityModel()
    model.block.compile(backend="aot_eager")
    return model


def _fp16() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))


def _run(rank: int, world_size: int, root: Path) -> dict:
    out: dict = {}
    # In-place edits after each step, and load_state_dict after setup.
    clamp = Clamp()
    out["clamp", "ddp"] = _fit(DDPStrategy(), ParityModel, world_size, callbacks=[clamp])[2], clamp.largest
    for stage, precision in ((2, "bf16-mixed"), (3, "32-true"), (3, "bf16-mixed"), (1, "bf16-mixed")):
        clamp = Clamp()
        params = _fit(ZeroStrategy(stage=stage), ParityModel, world_size, callbacks=[clamp], precision=precision)[2]
        out["clamp", stage, precision] = params, clamp.largest
    out["load", "ddp"] = _fit(DDPStrategy(), ParityModel, world_size, callbacks=[LoadAtStart()])[1]
    for stage in STAGES:
        for precision in ("32-true", "bf16-mixed"):
            out["load", stage, precision] = _fit(ZeroStrategy(stage=stage), ParityModel, world_size,
                                                 callbacks=[LoadAtStart()], precision=precision)[1]
    # grad_norm, the model summary.
    norms = GradNorms()
    _fit(DDPStrategy(), ParityModel, world_size, callbacks=[norms])
    out["norms", "ddp"] = norms.norms
    for stage in STAGES:
        norms = GradNorms()
        _fit(ZeroStrategy(stage=stage), ParityModel, world_size, callbacks=[norms])
        out["norms", stage] = norms.norms
    summary = SummaryTotal()
    _fit(ZeroStrategy(stage=3), TinyLM, world_size, steps=1, callbacks=[summary], enable_model_summary=True)
    out["summary"] = summary.total
    # Optimizers: Adagrad (state made in __init__) is element-wise; LBFGS is refused.
    out["adagrad", "ddp"] = _fit(DDPStrategy(), lambda: ConvNet(optimizer="adagrad"), world_size)[2]
    for stage in STAGES:
        out["adagrad", stage] = _fit(ZeroStrategy(stage=stage), lambda: ConvNet(optimizer="adagrad"), world_size)[2]
    out["lbfgs"] = _error(lambda: _fit(ZeroStrategy(stage=2), lambda: ConvNet(optimizer="lbfgs"), world_size))
    # Units that match nothing.
    out["units_none"] = _error(lambda: _fit(ZeroStrategy(stage=3, units=("Blok",)), TinyLM, world_size, steps=1))
    out["units_some"] = _error(lambda: _fit(ZeroStrategy(stage=3, units=("Block", "Blok")), TinyLM, world_size,
                                            steps=1))
    # Callbacks that need whole parameters.
    swa = lambda: StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)  # noqa: E731
    out["swa", "ddp"] = _fit(DDPStrategy(), ParityModel, world_size, steps=-1, callbacks=[swa()], max_epochs=3,
                             limit_train_batches=4)[2]
    for stage in (2, 3):
        out["swa", stage] = _fit(ZeroStrategy(stage=stage), ParityModel, world_size, steps=-1, callbacks=[swa()],
                                 max_epochs=3, limit_train_batches=4)[2]
    # fp16: the GradScaler user code reaches is torch's.
    plugin = _fp16()
    trainer = _fit(ZeroStrategy(stage=2, precision_plugin=plugin), ParityModel, world_size, steps=3)[0]
    scaler = trainer.precision_plugin.scaler
    out["scaler"] = (scaler is plugin.scaler and type(scaler) is torch.amp.GradScaler, scaler.get_growth_factor(),
                     scaler.get_scale(), sorted(scaler.state_dict()))
    # Activation checkpointing: parity, and no extra all-gather under zero3.
    out["ac", "ddp"] = _fit(DDPStrategy(), TinyLM, world_size)[2]
    for stage in STAGES:
        out["ac", stage] = _fit(ZeroStrategy(stage=stage, activation_checkpointing_policy=("Block",)), TinyLM,
                                world_size)[2]
    out["ac_units_linear"] = _fit(ZeroStrategy(stage=3, units=("Linear",), activation_checkpointing_policy=("Block",)),
                                  TinyLM, world_size)[2]
    for policy in ((), ("Block",)):
        out["gathers", policy] = _gathers(ZeroStrategy(stage=3, units=("Linear",), activation_checkpointing_policy=policy),
                                          TinyLM, world_size)
    # torch.compile of the whole model (Lightning's torch.compile(module), and module.compile()) and of one block.
    compiled = lambda: torch.compile(ParityModel(), backend="aot_eager")  # noqa: E731
    out["compile", "ddp"] = _fit(DDPStrategy(), compiled, world_size, steps=4)[2]
    for stage in (1, 2):
        out["compile", stage] = _fit(ZeroStrategy(stage=stage), compiled, world_size, steps=4)[2]
    for how, model_fn in (("whole", compiled), ("in place", _compiled_in_place), ("block", _block_compiled)):
        frames, monitor = CompileCounts(), ZeroMonitor()
        params = _fit(ZeroStrategy(stage=3, units=("Block",)), model_fn, world_size, steps=4,
                      callbacks=[frames, monitor])[2]
        out["compile", 3, how] = params, frames.counts, monitor.summary.compiled
    # A 0-d parameter through a sharded checkpoint into safetensors.
    trainer, _, params = _fit(ZeroStrategy(stage=3), ParityModel, world_size, steps=2)
    trainer.save_checkpoint(root / "scalar.ckpt")
    out["scalar"] = float(trainer.lightning_module.scale)
    return out


@lru_cache(maxsize=None)
def results(root: str) -> list[dict]:
    return run_on_ranks(lambda r, w: _run(r, w, Path(root)), 2)


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    return results(str(root)), root


@pytest.mark.parametrize("stage,precision", [(1, "bf16-mixed"), (2, "bf16-mixed"), (3, "32-true"), (3, "bf16-mixed")])
def test_in_place_edits_after_a_step_are_kept(per_rank, stage: int, precision: str) -> None:
    for rank in per_rank[0]:
        params, largest = rank["clamp", stage, precision]
        # Each step starts from clamped weights: one AdamW step moves a weight by about lr at most.
        assert len(largest) == 6 and max(largest[1:]) <= Clamp().bound + 1.5 * LR
        if precision == "32-true":
            _assert_same_steps(params, rank["clamp", "ddp"][0])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_load_state_dict_after_setup_is_trained_on(per_rank, stage: int, precision: str) -> None:
    for rank in per_rank[0]:
        got, want = np.array(rank["load", stage, precision]), np.array(rank["load", "ddp"])
        rtol = 1e-5 if precision == "32-true" else 3e-3
        np.testing.assert_allclose(got, want, rtol=rtol)


@pytest.mark.parametrize("stage", STAGES)
def test_strategy_grad_norm_equals_lightnings_under_ddp(per_rank, stage: int) -> None:
    for rank in per_rank[0]:
        got, want = rank["norms", stage], rank["norms", "ddp"]
        assert len(got) == len(want) == 6
        for a, b in zip(got, want):
            assert a.keys() == b.keys() and "grad_2.0_norm_total" in a
            np.testing.assert_allclose([a[k] for k in b], [b[k] for k in b], rtol=1e-5, atol=1e-7)


def test_zero3_model_summary_counts_every_parameter(per_rank) -> None:
    model = TinyLM()
    model.configure_model()
    assert all(rank["summary"] == sum(p.numel() for p in model.parameters()) for rank in per_rank[0])


@pytest.mark.parametrize("stage", STAGES)
def test_adagrad_matches_ddp(per_rank, stage: int) -> None:
    for rank in per_rank[0]:
        _assert_same_steps(rank["adagrad", stage], rank["adagrad", "ddp"])


def test_lbfgs_and_unmatched_units_are_refused_clearly(per_rank) -> None:
    rank = per_rank[0][0]
    assert rank["lbfgs"].startswith("ValueError: LBFGS cannot be sharded by ZeroStrategy: it re-evaluates the closure")
    assert rank["units_none"].startswith("ValueError: units=['Blok']: ['Blok'] match no module of TinyLM")
    # An entry that matches nothing is refused beside one that matches too (it was warned about, then ignored).
    assert rank["units_some"].startswith("ValueError: units=['Block', 'Blok']: ['Blok'] match no module of TinyLM "
                                         "(module classes with parameters here: Block, ")


@pytest.mark.parametrize("stage", [2, 3])
def test_stochastic_weight_averaging_matches_ddp(per_rank, stage: int) -> None:
    # zero3: the average in each rank's rows (more cases in test_weight_callbacks.py, EMA and pruning in
    # test_user_code.py)
    for rank in per_rank[0]:
        _assert_same_steps(rank["swa", stage], rank["swa", "ddp"])


def test_the_fp16_scaler_is_a_torch_grad_scaler(per_rank) -> None:
    is_the_plugins, growth, scale, keys = per_rank[0][0]["scaler"]
    assert is_the_plugins and growth == 2.0 and scale == 2.0**10  # the GradScaler the plugin was given, itself
    assert keys == ["_growth_tracker", "backoff_factor", "growth_factor", "growth_interval", "scale"]


@pytest.mark.parametrize("stage", STAGES)
def test_activation_checkpointing_matches_ddp(per_rank, stage: int) -> None:
    for rank in per_rank[0]:
        _assert_same_steps(rank["ac", stage], rank["ac", "ddp"])
        _assert_same_steps(rank["ac_units_linear"], rank["ac", "ddp"])


def test_activation_checkpointing_costs_no_extra_all_gather(per_rank) -> None:
    # TinyLM under units=("Linear",): 8 Linear units (4 per block; the tied head is in the root), gathered for forward
    # and again for backward but the last (kept gathered between them from the second step), and the root once.
    # Recomputing a Block re-runs its units' forward inside backward, and reuses the gather their backward needs.
    for rank in per_rank[0]:
        (plain, plain_forwards), (checkpointed, recomputed) = rank["gathers", ()], rank["gathers", ("Block",)]
        assert (plain_forwards, recomputed) == (2, 4)  # each of the 2 blocks recomputed once in backward
        assert plain == checkpointed == 8 + 7 + 1


@pytest.mark.parametrize("stage", [1, 2])
def test_torch_compile_under_zero1_and_zero2_matches_ddp(per_rank, stage: int) -> None:
    for rank in per_rank[0]:
        _assert_same_steps(rank["compile", stage], rank["compile", "ddp"])


@pytest.mark.parametrize("how", ["whole", "in place", "block"])
def test_torch_compile_under_zero3_matches_ddp_and_compiles_once(per_rank, how: str) -> None:
    # Each of the 4 steps against DDP's compiled model; every frame compiled in the first step, none after it; the
    # graph breaks are the unit's hooks (units=("Block",): one unit), none when the block is compiled on its own.
    for rank in per_rank[0]:
        params, counts, compiled = rank["compile", 3, how]
        _assert_same_steps(params, rank["compile", "ddp"])
        assert len(counts) == 4 and counts[0] > 0 and counts == [counts[0]] * 4
        assert compiled.frames_first_step == counts[0] and compiled.frames_after == 0 and compiled.other_breaks == {}
        assert (compiled.unit_breaks > 0) == (how != "block")


def test_a_zero_dim_parameter_consolidates_to_safetensors(per_rank) -> None:
    results_, root = per_rank
    consolidate(root / "scalar.ckpt", root / "scalar.safetensors")
    loaded = safetensors.torch.load_file(root / "scalar.safetensors")
    assert loaded["scale"].shape == () and float(loaded["scale"]) == results_[0]["scalar"]
    assert not list(root.glob("*.partial"))
