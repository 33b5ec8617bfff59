"""One CUDA device: ZeRO's CUDA paths (device placement, meta-device init on the GPU, fp16 with real loss scaling,
sharded checkpoints of CUDA tensors) against Lightning's single-device training; a zero3 fork from a process that
never initialized CUDA; ZeroMonitor's event timing. Skipped without a GPU (the offload modes: test_offload.py).

Each parity test runs twice: with the world-size-1 short cut, and with the collectives really issued
(``shortcut_single_rank=False``), so that one GPU executes every NCCL call the library makes (reduce-scatters,
all-gathers, all-reduces of norms and flags, broadcasts, the checkpoint's collectives). Two NCCL ranks cannot share
one GPU, so world size 1 with real collectives is how a single GPU proves the NCCL paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import consolidate
from lightning_zero.monitor import ZeroMonitor
from lightning_zero.sharding.materialize import generator_state
from tests.distributed.semantics_models import ConvNet
from tests.models import Recorder, StepSeededLM, flat_params

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _fit(strategy, precision=None, steps=8, model_cls=StepSeededLM, ckpt_path=None, callbacks=(), **trainer_kwargs):
    pl.seed_everything(11, verbose=False)
    model, recorder = model_cls(), Recorder()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cuda", devices=1, max_steps=steps, precision=precision,
        callbacks=[recorder, *callbacks],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, recorder


@pytest.fixture(params=["shortcut", "nccl"])
def collectives(request) -> str:
    return request.param


def _zero(stage: int, collectives: str = "shortcut", **kwargs) -> ZeroStrategy:
    kwargs["shortcut_single_rank"] = collectives == "shortcut"
    if stage == 3:
        kwargs.setdefault("units", ("Block",))
    return ZeroStrategy(stage=stage, **kwargs)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_equals_single_device_training(stage: int, collectives: str) -> None:
    _, want = _fit("auto")
    trainer, got = _fit(_zero(stage, collectives))
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)
    for a, b in zip(got.params, want.params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got.params[-1].device.type == "cuda"
    assert (trainer.strategy.comm_stats.total_calls > 0) == (collectives == "nccl")


@pytest.mark.parametrize("stage", [2, 3])
def test_find_unused_parameters_on_nccl(stage: int, collectives: str) -> None:
    from tests.models import ParityModel

    _, want = _fit(ZeroStrategy(stage=2, find_unused_parameters=True), model_cls=lambda: ParityModel(with_unused=True))
    _, got = _fit(_zero(stage, collectives, find_unused_parameters=True, units=()),
                  model_cls=lambda: ParityModel(with_unused=True))
    for a, b in zip(got.params, want.params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _fp16() -> MixedPrecision:
    # A small initial scale: ZeRO's gradients are fp16 and would overflow (and skip) the first steps at 2**16, where
    # the single-device reference keeps fp32 gradients under autocast and would not, so the runs would not align.
    return MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda", init_scale=2.0**8))


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_tracks_single_device_training(stage: int, precision: str, collectives: str) -> None:
    if precision == "16-mixed":
        reference, want = _fit(SingleDeviceStrategy("cuda:0", precision_plugin=_fp16()), steps=20)
        trainer, got = _fit(_zero(stage, collectives, precision_plugin=_fp16()), steps=20)
    else:
        reference, want = _fit("auto", precision=precision, steps=20)
        trainer, got = _fit(_zero(stage, collectives), precision=precision, steps=20)
    assert max(abs(a - b) / abs(b) for a, b in zip(got.losses, want.losses)) < 3e-3
    plugin = trainer.strategy.precision_plugin
    assert plugin.precision == precision and (plugin.scaler is not None) == (precision == "16-mixed")
    if plugin.scaler is not None:  # no step skipped (20 unskipped in a row), as on one device
        assert plugin.scaler.state_dict() == reference.precision_plugin.scaler.state_dict()
        assert plugin.scaler.state_dict()["_growth_tracker"] == 20 and plugin.scaler.get_scale() == 2.0**8


def test_meta_init_on_the_gpu_equals_the_eager_build(collectives: str) -> None:
    # steps=0: built in configure_model and set up, never trained; after fit both modules hold their weights on the
    # CPU. The single-device run builds eagerly on the GPU, drawing from the CUDA generator, as materialization does
    # (with the collectives issued, the generator state is broadcast over NCCL: a CUDA tensor).
    eager, _ = _fit("auto", steps=0)
    sharded, _ = _fit(_zero(3, collectives), steps=0)
    torch.testing.assert_close(flat_params(sharded.lightning_module), flat_params(eager.lightning_module), rtol=0, atol=0)


def test_sharded_checkpoint_of_cuda_tensors_resumes_exactly(tmp_path: Path, collectives: str) -> None:
    _, whole = _fit(_zero(3, collectives), precision="bf16-mixed", steps=6)
    first, _ = _fit(_zero(3, collectives), precision="bf16-mixed", steps=3)
    first.save_checkpoint(tmp_path / "run.ckpt")
    _, resumed = _fit(_zero(2, collectives), precision="bf16-mixed", steps=6, ckpt_path=tmp_path / "run.ckpt")
    np.testing.assert_allclose(resumed.losses, whole.losses[3:], rtol=1e-3)
    keys = consolidate(tmp_path / "run.ckpt", tmp_path / "w.safetensors")
    assert "lm.head.weight" in keys


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sync_batchnorm_on_the_gpu(stage: int, collectives: str, monkeypatch) -> None:
    # SyncBatchNorm needs GPU modules (refused on CPU, as DDP does). The reference is Lightning's DDP with
    # sync_batchnorm on the same device: ConvNet's data come from a DataLoader, whose order the distributed sampler
    # decides, so a single-device run sees other batches. Lightning converts at setup and reverts at teardown (under
    # DDP as under ours): the type is read while training. cuDNN's deterministic kernels keep both runs' convolution
    # gradients free of atomics' ordering.
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    seen = []

    class BatchNormType(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, *_args) -> None:
            seen.append(type(pl_module.bn))

    want_trainer, want = _fit(DDPStrategy(), model_cls=ConvNet, sync_batchnorm=True, callbacks=[BatchNormType()])
    trainer, got = _fit(_zero(stage, collectives, units=("Conv2d", "Linear")), model_cls=ConvNet, sync_batchnorm=True,
                        callbacks=[BatchNormType()])
    assert len(seen) == 16 and set(seen) == {torch.nn.SyncBatchNorm}
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)
    for a, b in zip(got.params, want.params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(trainer.lightning_module.bn, name).cpu(),
                                   getattr(want_trainer.lightning_module.bn, name).cpu(), rtol=1e-5, atol=1e-6)


def test_a_recorded_seed_makes_the_state_the_cuda_generator_gets_from_that_seed() -> None:
    # What setup does with the seed a launching process without CUDA recorded (sharding/materialize.py).
    device = torch.device("cuda", 0)
    torch.manual_seed(5)
    seeded = torch.cuda.get_rng_state(device)
    torch.manual_seed(6)
    assert torch.equal(generator_state(device, 5), seeded)


def test_zero3_fork_from_a_process_that_never_initialized_cuda(tmp_path: Path) -> None:
    # A fresh interpreter (this one has initialized CUDA): init_module() and the fork leave its CUDA uninitialized,
    # Lightning forks the rank, and the rank materializes what an eager build on the GPU draws from the same seed.
    repo = Path(__file__).resolve().parents[2]
    # Without this process's rendezvous variables: its earlier fits' store may still hold MASTER_PORT.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
                                                            "LOCAL_RANK", "NODE_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    job = subprocess.run([sys.executable, str(repo / "tests" / "gpu" / "fork_job.py"), str(tmp_path)], cwd=repo,
                         env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    assert json.loads(job.stdout.strip().splitlines()[-1]) == {
        "cuda_initialized_before_fit": False,
        "cuda_initialized_after_fit": False,
        "materialized_equals_eager": True,
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_monitor_times_gpu_steps_with_events(stage: int) -> None:
    # CUDA events on the compute stream, read once the device passed them (monitor.py, [Note: timing a step on a GPU]).
    monitor = ZeroMonitor()
    trainer = pl.Trainer(strategy=_zero(stage, "nccl"), accelerator="cuda", devices=1, max_steps=6, callbacks=[monitor],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(StepSeededLM())
    summary = monitor.summary
    assert summary is not None and summary.steps == 6 and summary.steps_timed == 5
    assert all(step.seconds > 0 for step in monitor._steps) and summary.throughput > 0


@pytest.mark.parametrize("stage", [1, 3])
def test_lean_memory_is_decided_from_the_gpus_memory(stage: int, monkeypatch) -> None:
    # On CUDA the budget is the device's memory (memory_policy.memory_budget), and the share is all-reduced over NCCL
    # (a CUDA tensor). A small model on a 140 GiB GPU runs fast; the same model against a budget of 4x its states runs
    # lean, and both train to the same losses (lean or fast changes when memory is returned, never a value).
    from lightning_zero import memory_policy

    device = torch.device("cuda", 0)
    assert memory_policy.memory_budget(device, 1) == torch.cuda.get_device_properties(device).total_memory
    fast_trainer, fast = _fit(_zero(stage, "nccl"))
    assert fast_trainer.strategy.runtime.lean is False
    model = StepSeededLM()
    model.configure_model()
    states = memory_policy.model_state_share(_zero(stage).config, model, 1, "32-true", 1)
    monkeypatch.setattr(memory_policy, "memory_budget", lambda device, ranks: int(4 * states))
    lean_trainer, lean = _fit(_zero(stage, "nccl"))
    assert lean_trainer.strategy.runtime.lean is True
    np.testing.assert_allclose(lean.losses, fast.losses, rtol=1e-6)
