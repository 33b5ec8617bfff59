"""Optimizer offload (``offload_optimizer="cpu"`` / ``"disk"``) and stage-3 parameter offload (``offload_params``)
against the same stage without offload, every step, 2 ranks; where each model state lives, against ZeRO-Offload's
figures; checkpoints that move between offloaded and in-device runs; disk offload's files (private, removed) and
its errors (a missing, unwritable or full directory: one clear error on every rank before training, nothing left)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import ParityModel, Recorder, StepSeededLM, make_trainer

STAGES = (1, 2, 3)
OFFLOADS = {
    "cpu": {"offload_optimizer": "cpu"},
    "cpu+params": {"offload_optimizer": "cpu", "offload_params": "cpu"},
    "disk": {"offload_optimizer": "disk", "offload_subgroup_mb": 0.01},  # about 2,600 parameters per sub-group
    "disk+params": {"offload_optimizer": "disk", "offload_params": "disk", "offload_subgroup_mb": 0.01},
}
# Offload steps with torch's fused CPU kernels, the in-device run with foreach ones: they round differently.
RTOL, ATOL = 1e-5, 1e-6
MIXED_RTOL = 3e-3


def _cases():
    for stage in STAGES:
        for offload in OFFLOADS:
            if offload.endswith("+params") and stage != 3:
                continue
            for optimizer in ("adamw", "sgd"):
                yield stage, offload, optimizer


class Placement(pl.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 2:
            self.held = trainer.strategy.model_state_bytes()
            self.fused = [g.get("fused") for g in optimizer.param_groups]


def _fit(strategy, world_size, optimizer="adamw", precision="32-true", callbacks=(), steps=6):
    pl.seed_everything(3, verbose=False)
    recorder = Recorder()
    trainer = make_trainer(strategy, world_size, max_steps=steps, callbacks=[*callbacks, recorder], precision=precision)
    trainer.fit(ParityModel(optimizer, d_model=32))
    return recorder


def _options(offload: str, root: Path) -> dict:
    options = dict(OFFLOADS[offload])
    if offload.startswith("disk"):
        options["offload_dir"] = str(root / "offload")
    return options


class Files(pl.Callback):
    """The disk offload files while training: their modes, and their directory's."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        (directory,) = [d for d in self.root.iterdir() if d.name.startswith(f"lightning_zero-rank{trainer.global_rank}-")]
        files = list(directory.iterdir())
        self.modes = (oct(directory.stat().st_mode & 0o777), {oct(f.stat().st_mode & 0o777) for f in files}, len(files))


def _run(rank: int, world_size: int, root: Path) -> dict:
    out = {}
    (root / "offload").mkdir(exist_ok=True)
    for stage, offload, optimizer in _cases():
        base = _fit(ZeroStrategy(stage=stage), world_size, optimizer)
        got = _fit(ZeroStrategy(stage=stage, **_options(offload, root)), world_size, optimizer)
        out["fp32", stage, offload, optimizer] = (base.params, got.params)
    for stage in STAGES:
        base = _fit(ZeroStrategy(stage=stage), world_size, precision="bf16-mixed", steps=10)
        got = _fit(ZeroStrategy(stage=stage, offload_optimizer="cpu"), world_size, precision="bf16-mixed", steps=10)
        out["bf16", stage] = (base.losses, got.losses)
    for stage, offload in ((2, "cpu"), (3, "cpu"), (3, "cpu+params"), (2, "disk"), (3, "disk+params")):
        placement = Placement()
        _fit(ZeroStrategy(stage=stage, **_options(offload, root)), world_size, precision="bf16-mixed",
             callbacks=[placement], steps=3)
        out["placement", stage, offload] = (placement.held, placement.fused)
    files = Files(root / "offload")
    _fit(ZeroStrategy(stage=3, **_options("disk+params", root)), world_size, callbacks=[files], steps=2)
    out["files"] = files.modes, _own_files(root / "offload", rank)
    out["resume"] = _resume(world_size, root)
    out["errors"] = _disk_errors(world_size, root)
    return out


def _own_files(directory: Path, rank: int) -> list[str]:
    """This rank's offload directories (another rank may still be removing its own)."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(f"lightning_zero-rank{rank}-"))


def _disk_errors(world_size: int, root: Path) -> dict:
    import shutil
    import tempfile

    from tests.distributed.test_lightning_semantics import _error

    def fit(directory) -> str:
        return _error(lambda: _fit(ZeroStrategy(stage=3, offload_optimizer="disk", offload_dir=str(directory)),
                                   world_size, steps=1))

    out = {"missing": fit(root / "nowhere")}
    mkdtemp = tempfile.mkdtemp  # the tests may run as root, whom a read-only mode does not stop: refuse as the OS would

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    tempfile.mkdtemp = refuse
    try:
        out["unwritable"] = fit(root / "offload")
    finally:
        tempfile.mkdtemp = mkdtemp
    real = shutil.disk_usage
    shutil.disk_usage = lambda path: real(path)._replace(free=1000 if torch.distributed.get_rank() == 1 else 10**12)
    try:
        out["full"] = fit(root / "offload")  # full on rank 1 only: rank 0 must not go on alone
    finally:
        shutil.disk_usage = real
    out["left"] = _own_files(root / "offload", torch.distributed.get_rank())
    return out


def _resume(world_size: int, root: Path) -> dict:
    """Saved with offload, resumed without (and the reverse): the same as an uninterrupted run."""
    class LoadedInto(pl.Callback):
        """Where a resumed disk offload holds the optimizer states it loaded, before its first step."""

        in_files: bool | None = None

        def on_train_start(self, trainer, pl_module):
            offload = trainer.strategy.runtime.offload
            if hasattr(offload, "store"):
                states = [v for o in trainer.optimizers for st in o.state.values() for v in st.values()
                          if torch.is_tensor(v) and v.dim() > 0 and v.numel()]
                self.in_files = bool(states) and all(offload.store.holds(v) for v in states)

    def fit(strategy, steps, ckpt=None):
        pl.seed_everything(5, verbose=False)
        recorder, loaded = Recorder(), LoadedInto()
        trainer = make_trainer(strategy, world_size, max_steps=steps, callbacks=[recorder, loaded])
        trainer.fit(StepSeededLM(), ckpt_path=ckpt)
        return trainer, recorder, loaded.in_files

    out = {}
    _, whole, _ = fit(ZeroStrategy(stage=3), 8)
    for name, first, second in (
        ("offload->plain", {"offload_optimizer": "cpu", "offload_params": "cpu"}, {}),
        ("plain->offload", {}, {"offload_optimizer": "cpu"}),
        ("plain->disk", {}, {"offload_optimizer": "disk", "offload_params": "disk", "offload_dir": str(root)}),
    ):
        trainer, _, _ = fit(ZeroStrategy(stage=3, **first), 4)
        trainer.save_checkpoint(root / f"{name}.ckpt")
        stage = 3 if second.get("offload_params") or not second else 2
        _, resumed, in_files = fit(ZeroStrategy(stage=stage, **second), 8, root / f"{name}.ckpt")
        out[name] = (whole.params[4:], resumed.params, in_files)
    return out


@lru_cache(maxsize=None)
def results(root: str) -> list[dict]:
    return run_on_ranks(lambda r, w: _run(r, w, Path(root)), 2)


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory) -> list[dict]:
    return results(str(tmp_path_factory.mktemp("offload")))


@pytest.mark.parametrize("stage,offload,optimizer", list(_cases()))
def test_fp32_offload_matches_the_same_stage_every_step(per_rank, stage, offload, optimizer) -> None:
    for rank in per_rank:
        base, got = rank["fp32", stage, offload, optimizer]
        assert len(got) == len(base) == 6
        for step, (a, b) in enumerate(zip(got, base)):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step}: {m}")
        assert not torch.equal(got[0], got[-1])


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_mixed_offload_tracks_the_same_stage(per_rank, stage: int) -> None:
    for rank in per_rank:
        base, got = (np.array(x) for x in rank["bf16", stage])
        assert len(got) == 10 and np.max(np.abs(got - base) / np.abs(base)) < MIXED_RTOL


def _psi() -> int:
    return sum(p.numel() for p in ParityModel("adamw", d_model=32).parameters())


@pytest.mark.parametrize(
    "stage,offload,device_per_psi,host_per_psi,disk_per_psi",
    [
        # ZeRO-Offload stage 2: bf16 parameters 2Ψ and gradient shards 2Ψ/N on the device; fp32 masters and Adam's
        # two moments, 12Ψ/N, on the host.
        (2, "cpu", lambda n: 2 + 2 / n, lambda n: 12 / n, lambda n: 0),
        # Stage 3: bf16 parameter shards and gradient shards on the device.
        (3, "cpu", lambda n: 4 / n, lambda n: 12 / n, lambda n: 0),
        # Stage 3 with the parameter shards on the host too: only the gradient shards stay.
        (3, "cpu+params", lambda n: 2 / n, lambda n: 14 / n, lambda n: 0),
        # Disk: the 12Ψ/N go to files (Adam's 0-d step counters stay in host memory), and so do the bf16 gradient
        # shards, 2Ψ/N, as the training device here is the host (on CUDA they stay on the device).
        (2, "disk", lambda n: 2, lambda n: 0, lambda n: 14 / n),
        (3, "disk+params", lambda n: 0, lambda n: 0, lambda n: 16 / n),
    ],
    ids=["zero2-cpu", "zero3-cpu", "zero3-cpu-params", "zero2-disk", "zero3-disk-params"],
)
def test_each_state_lives_where_zero_offload_puts_it(per_rank, stage, offload, device_per_psi, host_per_psi,
                                                     disk_per_psi) -> None:
    psi, n = _psi(), 2
    for rank in per_rank:
        held, fused = rank["placement", stage, offload]
        # Padding rows and Adam's per-parameter step counters (4 bytes each) are the only extra bytes.
        assert held.device == pytest.approx(device_per_psi(n) * psi, rel=0.05, abs=200)
        assert held.host == pytest.approx(host_per_psi(n) * psi, rel=0.05, abs=200)
        assert held.disk == pytest.approx(disk_per_psi(n) * psi, rel=0.05)
        # the user's param_groups as given: the fused CPU AdamW is set for the host step only (counted in
        # tests/unit/test_offload_pipeline.py)
        assert fused == [None]


def test_disk_offload_files_are_private_and_removed(per_rank) -> None:
    for rank in per_rank:
        (directory_mode, file_modes, count), left = rank["files"]
        assert directory_mode == "0o700" and file_modes == {"0o600"} and count > 10
        assert left == []


def test_a_missing_unwritable_or_full_directory_is_one_clear_error_on_every_rank(per_rank) -> None:
    for rank, result in enumerate(per_rank):
        errors = result["errors"]
        assert errors["missing"].startswith("OffloadDiskError: offload_dir=") and "does not exist" in errors["missing"]
        assert errors["unwritable"].endswith("offload' is not writable: Permission denied")
        if rank == 1:
            assert "has 0.00 GiB free, disk offload needs about" in errors["full"]
        else:
            assert errors["full"].startswith("OffloadDiskError: disk offload could not be set up on another rank")
        assert errors["left"] == []  # no partial state


@pytest.mark.parametrize("direction", ["offload->plain", "plain->offload", "plain->disk"])
def test_checkpoints_move_between_offloaded_and_in_device_runs(per_rank, direction: str) -> None:
    for rank in per_rank:
        want, got, in_files = rank["resume"][direction]
        # A resume into disk offload puts each loaded optimizer state straight into a file of its own.
        assert in_files is (True if direction == "plain->disk" else None)
        assert len(got) == len(want) == 4
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
