"""Disk faults under disk offload (zero3, optimizer states and parameter shards in files), 2 ranks, each fault in its
own fork: the directory removed or made read-only mid-run, every file of one rank truncated (the SIGBUS case), the
disk full when the first step moves the optimizer's states into files, a write-back that fails (ENOSPC from
``fdatasync``, as on filesystems whose preallocation does not reserve), and an exception in the middle of fit. See [Note: disk faults]
in lightning_zero/offload/disk.py for what each does and why.

Each fault either leaves training unchanged (same parameters as an uninterrupted run) or ends it with an
``OffloadDiskError`` naming the file on the rank that hit it, and an error naming that rank on its peer; either way no
offload file is left behind, and a checkpoint saved before the fault resumes to the uninterrupted run's parameters.

Not tested here: a full disk for the files that exist (they are preallocated: nothing to fail), the space check at
set-up (tests/distributed/test_offload.py, with ``shutil.disk_usage`` faked on one rank), and permissions when the
tests run as root (a read-only directory does not stop root; the run below then checks only that training goes on and
the directory goes). A truncation between the size check and the step still kills the process with SIGBUS.
"""

from __future__ import annotations

import errno
import os
import shutil
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.models import Recorder, StepSeededLM, make_trainer
from tests.reliability.faults import WatchedZero
from tests.reliability.ranks import launch

STEPS = 6
FAULT_STEP = 3  # the optimizer step (1-based) at which a fault strikes; a checkpoint is saved after step 2
FAULTY_RANK = 1


def _strategy(root: Path) -> WatchedZero:
    return WatchedZero(3, offload_optimizer="disk", offload_params="disk", offload_dir=str(root / "offload"),
                       offload_subgroup_mb=0.001, failure_timeout_s=2.0, heartbeat_s=0.25)


def _own_directory(root: Path, rank: int) -> Path:
    (directory,) = (root / "offload").glob(f"lightning_zero-rank{rank}-*")
    return directory


def _left(root: Path, rank: int | None = None) -> list[str]:
    """What is in the offload directory: everything, or ``rank``'s own (its peer may still be removing its own)."""
    prefix = "lightning_zero-rank" if rank is None else f"lightning_zero-rank{rank}-"
    return sorted(p.name for p in (root / "offload").iterdir() if p.name.startswith(prefix))


class _Fault(pl.Callback):
    """Applies one fault on ``ranks`` when ``FAULT_STEP`` begins (``global_step == FAULT_STEP - 1``)."""

    def __init__(self, kind: str, root: Path, ranks: tuple[int, ...]) -> None:
        self.kind, self.root, self.ranks = kind, root, ranks

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != FAULT_STEP - 1 or trainer.global_rank not in self.ranks:
            return
        directory = _own_directory(self.root, trainer.global_rank)
        if self.kind == "removed":
            shutil.rmtree(directory)
        elif self.kind == "read-only":
            directory.chmod(0o500)
        elif self.kind == "truncated":
            for file in directory.iterdir():
                os.truncate(file, 0)
        elif self.kind == "write-back":
            _FailingSync.armed = True
        elif self.kind == "raise":
            raise RuntimeError(f"injected failure at step {FAULT_STEP}")


class _FailingSync:
    """``os.fdatasync`` that fails with ENOSPC once armed (the write-back of a filesystem whose preallocation did not
    reserve the space)."""

    armed = False
    real = staticmethod(os.fdatasync)

    def __call__(self, fd: int) -> None:
        if _FailingSync.armed:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _FailingSync.real(fd)


def _full_at_first_step(rank: int) -> None:
    """From the first step on, reserving a new file fails with ENOSPC on ``rank`` (the set-up's files exist)."""
    real = os.posix_fallocate

    class FullDisk(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            if trainer.global_rank == rank:
                os.posix_fallocate = lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))

        def on_train_end(self, trainer, pl_module):
            os.posix_fallocate = real

    return FullDisk()


def _fit(rank: int, world_size: int, root: Path, kind: str | None, ranks: tuple[int, ...] = (FAULTY_RANK,)):
    """One fit of ``STEPS`` with a checkpoint every 2 steps; what it raised (type, text) and the parameters."""
    pl.seed_everything(5, verbose=False)
    (root / "offload").mkdir(exist_ok=True)
    os.fdatasync = _FailingSync()  # this forked rank only: a write-back that can be made to fail
    recorder = Recorder()
    callbacks = [recorder, ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1)]
    if kind == "full":
        callbacks.append(_full_at_first_step(FAULTY_RANK))
    elif kind is not None:
        callbacks.append(_Fault(kind, root, ranks))
    trainer = make_trainer(_strategy(root), world_size, max_steps=STEPS, callbacks=callbacks, enable_checkpointing=True)
    try:
        trainer.fit(StepSeededLM())
    except BaseException as err:  # noqa: BLE001 (what is raised is the result)
        return type(err).__name__, "".join(traceback.format_exception(err)), recorder.params, _left(root, rank)
    return "finished", "", recorder.params, _left(root, rank)


def _resume(rank: int, world_size: int, root: Path, checkpoint: Path):
    pl.seed_everything(5, verbose=False)
    recorder = Recorder()
    trainer = make_trainer(_strategy(root), world_size, max_steps=STEPS, callbacks=[recorder])
    trainer.fit(StepSeededLM(), ckpt_path=checkpoint)
    return recorder.params, _left(root, rank)


@dataclass
class Run:
    root: Path
    outcomes: list


KINDS = ("removed", "read-only", "truncated", "full", "write-back", "raise")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    out = {}
    for kind in (None, *KINDS):
        root = tmp_path_factory.mktemp(kind or "uninterrupted")
        ranks = (0, 1) if kind in ("removed", "read-only", "raise") else (FAULTY_RANK,)
        outcomes = launch(partial(_fit, root=root, kind=kind, ranks=ranks), 2, timeout_s=120)
        out[kind] = Run(root, outcomes)
    return out


def _value(outcome):
    assert outcome.exitcode == 0 and outcome.error is None, outcome  # returned: no SIGBUS, no watchdog exit
    return outcome.value


@pytest.mark.parametrize("kind", ["removed", "read-only"])
def test_files_that_are_open_keep_working_when_their_directory_goes(runs, kind):
    # Every file exists from the first step on and stays usable through its descriptor and mapping.
    base = runs[None].outcomes
    for rank, outcome in enumerate(runs[kind].outcomes):
        status, text, params, left = _value(outcome)
        assert status == "finished", text
        want = _value(base[rank])[2]
        assert len(params) == len(want) == STEPS
        for a, b in zip(params, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert left == []  # removed at teardown, the read-only one too (made writable first)
    assert _left(runs[kind].root) == []


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("truncated", r".*/lightning_zero-rank1-\w+/t\d{6}\.bin was truncated to 0 bytes while disk offload uses "
                      r"it \(\d+ bytes\): something outside this run changed the offload directory"),
        ("full", r"cannot reserve \d+ bytes in .*/lightning_zero-rank1-\w+/t\d{6}\.bin: No space left on device"),
        ("write-back", r"cannot write disk offload state back to .*/lightning_zero-rank1-\w+/t\d{6}\.bin: No space "
                       "left on device"),
    ],
)
def test_a_disk_fault_is_one_error_naming_the_file_and_the_peer_names_the_rank(runs, kind, message):
    import re

    run = runs[kind]
    for rank, outcome in enumerate(run.outcomes):
        status, text, params, left = _value(outcome)
        if rank == FAULTY_RANK:
            assert status == "OffloadDiskError", text
            assert re.search(r"OffloadDiskError: " + message, text), text
            assert str(run.root / "offload") in text
        else:
            assert status != "finished" and f"rank {FAULTY_RANK}" in text, text
        assert left == []  # its own, when it returned
    assert _left(run.root) == []  # nothing left by either rank


def test_an_exception_during_fit_removes_the_offload_directory(runs):
    for outcome in runs["raise"].outcomes:
        status, text, params, left = _value(outcome)
        assert status == "RuntimeError" and f"injected failure at step {FAULT_STEP}" in text, text
        assert left == [] and len(params) == FAULT_STEP - 1
    assert _left(runs["raise"].root) == []


@pytest.mark.parametrize("kind", ["truncated", "full", "write-back", "raise"])
def test_the_last_checkpoint_before_a_disk_fault_resumes_to_the_uninterrupted_run(runs, kind):
    run = runs[kind]
    saved = sorted((run.root / "ckpt").glob("*.ckpt"))
    if kind == "full":  # the fault struck at the first step: nothing was saved, nothing to resume
        assert saved == []
        return
    assert [p.name for p in saved] == ["epoch=0-step=2.ckpt"]
    resumed = launch(partial(_resume, root=run.root, checkpoint=saved[0]), 2, timeout_s=120)
    base = runs[None].outcomes
    for rank, outcome in enumerate(resumed):
        assert outcome.exitcode == 0 and outcome.error is None, outcome
        params, left = outcome.value
        want = _value(base[rank])[2][2:]
        assert len(params) == len(want) == STEPS - 2
        for a, b in zip(params, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert left == []
