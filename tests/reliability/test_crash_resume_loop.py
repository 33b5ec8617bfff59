"""Crash and resume, again and again: a seeded plan kills (or stops, or makes raise) a random rank at a random point
(forward, backward, optimizer step, while the ranks write a checkpoint) of a random step, ``CRASHES`` times in one run,
resuming from ``last.ckpt`` each time; then the run finishes.

After every crash: no rank hung (each ended within the bound), and every checkpoint that was reported saved (rank 0
returned from ``save_checkpoint``) is readable (its checksums hold and ``consolidate`` reads every tensor) and holds
exactly the parameters of an uninterrupted run at its step. At the end the parameters equal the uninterrupted run's,
bitwise. Run with ``python -m pytest -m slow tests/reliability/test_crash_resume_loop.py -s`` (prints the plan).
"""

from __future__ import annotations

import random
import time
import traceback
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero.checkpoint import consolidate
from tests.models import Recorder, TinyLM, flat_params, make_trainer
from tests.reliability.faults import POINTS, Fault, FaultyLM, WatchedZero
from tests.reliability.ranks import launch

SEED, CRASHES = 14, 20
STEPS, EVERY, STAGE, WORLD_SIZE = 45, 3, 2, 2
HEARTBEAT_S, TIMEOUT_S = 0.25, 2.0
BOUND_S = TIMEOUT_S + HEARTBEAT_S + 2.0 + 1.0  # the slowest path: a silent peer, then the grace period


class ReportingZero(WatchedZero):
    """Rank 0 appends ``path<TAB>global step`` to ``log`` once a save has returned: the checkpoints "reported saved"."""

    def __init__(self, log: Path) -> None:
        super().__init__(STAGE, failure_timeout_s=TIMEOUT_S, heartbeat_s=HEARTBEAT_S)
        self.log = log

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        step = checkpoint["global_step"]
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.global_rank == 0:
            with open(self.log, "a") as f:
                f.write(f"{filepath}\t{step}\n")


def _run(rank: int, world_size: int, root: Path, fault: Fault | None, resume: bool):
    pl.seed_everything(5, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=EVERY, save_last=True, save_top_k=-1)
    trainer = make_trainer(ReportingZero(root / "saved.log"), world_size, max_steps=STEPS, callbacks=[checkpoints],
                           enable_checkpointing=True)
    model = FaultyLM(fault, root / "struck_at")
    try:
        trainer.fit(model, ckpt_path="last" if resume else None)
    except BaseException as err:
        return "failed", "".join(traceback.format_exception_only(err)), time.monotonic()  # with the notes
    return "finished", flat_params(model), time.monotonic()


def _uninterrupted(rank: int, world_size: int) -> list[torch.Tensor]:
    pl.seed_everything(5, verbose=False)
    recorder = Recorder()
    make_trainer(WatchedZero(STAGE), world_size, max_steps=STEPS, callbacks=[recorder]).fit(FaultyLM())
    return recorder.params  # after each step


def _reported(root: Path) -> dict[Path, int]:
    """Every checkpoint reported saved, at the step of its latest report (``last.ckpt`` is saved over and over)."""
    log = root / "saved.log"
    lines = log.read_text().splitlines() if log.is_file() else []
    return {Path(path): int(step) for path, step in (line.split("\t") for line in lines)}


def _weights(path: Path, out: Path) -> torch.Tensor:
    """Read every tensor of the checkpoint (after checking its checksums); its parameters, flat, in model order."""
    consolidate(path, out, training_state=True)  # checks every byte first
    model = TinyLM()
    model.configure_model()
    model.load_state_dict(torch.load(out, weights_only=True)["state_dict"])
    return flat_params(model)


def _next_fault(rng: random.Random, resume_step: int) -> Fault:
    """A fault within the next three checkpoint intervals, so that the crashes spread over the whole run."""
    rank, point = rng.randrange(WORLD_SIZE), rng.choice(POINTS)
    action = rng.choices(["kill", "raise", "stop"], weights=[6, 2, 2])[0]
    if point == "save" and resume_step + EVERY <= STEPS:  # one of the next checkpoint step's two saves (step, last)
        return Fault(rank, rng.randint(1, 2), point, action)
    point = rng.choice(POINTS[:3]) if point == "save" else point
    return Fault(rank, min(STEPS - 1, resume_step + rng.randrange(3 * EVERY)), point, action)


@pytest.mark.slow
def test_repeated_crashes_and_resumes_lose_nothing(tmp_path: Path) -> None:
    reference = launch(_uninterrupted, WORLD_SIZE, timeout_s=300)[0].value
    rng, resume_step, plan, checked = random.Random(SEED), 0, [], 0
    for crash in range(CRASHES):
        fault = _next_fault(rng, resume_step)
        (tmp_path / "struck_at").unlink(missing_ok=True)
        outcomes = launch(partial(_run, root=tmp_path, fault=fault, resume=crash > 0), WORLD_SIZE, timeout_s=120,
                          expendable={fault.rank})
        struck_at = float((tmp_path / "struck_at").read_text())  # the fault fired
        for outcome in outcomes:
            if outcome.rank != fault.rank:  # the survivor failed too, in time, naming the failed rank
                ended = outcome.ended if outcome.value is None else outcome.value[2]
                assert outcome.exitcode is not None and ended - struck_at < BOUND_S, (fault, outcome)
                text = outcome.stderr if outcome.value is None else outcome.value[1]
                assert outcome.value is None or outcome.value[0] == "failed", (fault, outcome.value)
                assert f"rank {fault.rank}" in text or fault.action == "raise" and fault.point == "save", (fault, text)
        reported = _reported(tmp_path)
        for path, step in reported.items():  # every checkpoint reported saved: readable and exact
            assert torch.equal(_weights(path, tmp_path / "weights.pt"), reference[step - 1]), (fault, path, step)
        checked += len(reported)
        last = tmp_path / "ckpt" / "last.ckpt"
        resume_step = torch.load(last, mmap=True, weights_only=True)["global_step"] if last.exists() else 0
        plan.append(f"crash {crash}: {fault} -> resume from step {resume_step}, {len(reported)} checkpoints verified")
        print(plan[-1])
    outcomes = launch(partial(_run, root=tmp_path, fault=None, resume=True), WORLD_SIZE, timeout_s=300)
    for outcome in outcomes:
        assert outcome.value is not None and outcome.value[0] == "finished", (plan, outcome.error, outcome.value)
        assert torch.equal(outcome.value[1], reference[-1]), plan
    print(f"{CRASHES} crashes, {checked} checkpoint verifications, final parameters equal the uninterrupted run's")
