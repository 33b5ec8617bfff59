"""A rank dies or fails: every other rank ends within a bounded time with an error naming it, and a rerun from the
last checkpoint reaches exactly the losses and parameters of an uninterrupted run.

Each scenario forks its own ranks (a group with a dead member cannot be reused): rank ``FAILING`` fails at
``FAULT_STEP`` by SIGKILL, SIGSTOP (a node that vanished without closing its connections) or an exception, in the
forward, the backward, the optimizer step or while it writes its rows of a checkpoint. ``ModelCheckpoint`` saves
every 2 steps with ``save_last``; one more fork then resumes every scenario with ``ckpt_path="last"`` and compares
each step after the resume point with an uninterrupted run of the same stage.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero.watchdog import EXIT_CODE, PROBE_S
from tests.models import flat_params, make_trainer
from tests.reliability.faults import Fault, FaultyLM, WatchedZero
from tests.reliability.ranks import launch

HEARTBEAT_S, TIMEOUT_S = 0.25, 2.0
STEPS, EVERY, FAULT_STEP = 8, 2, 5
#: A dead peer (connections closed): the survivor's collective raises at once, naming it takes a probe (PROBE_S).
DEAD_BOUND_S = PROBE_S + 1.0
#: A silent peer, or one that failed while this rank waits in a collective: the failure timeout (silent peers only),
#: one heartbeat to notice, the grace period (max(1, 2 heartbeats)) to receive the error, then the exit.
BLOCKED_BOUND_S = TIMEOUT_S + HEARTBEAT_S + 1.0 + 1.0


@dataclass(frozen=True)
class Scenario:
    name: str
    stage: int
    fault: Fault
    world_size: int = 2
    linger_s: float = 0.0  # the raising rank stays alive this long after fit raised (a notebook, a slow teardown)
    busy: bool = False  # the survivors' training thread runs Python when the watchdog decides (no collective)

    @property
    def resumed_from(self) -> int:
        """The step of ``last.ckpt`` when the fault struck."""
        if self.fault.point == "save":  # the 3rd save (step 4's) dies: last.ckpt is still step 2's
            return EVERY
        return FAULT_STEP // EVERY * EVERY


SCENARIOS = [
    Scenario("kill-forward-z3", 3, Fault(1, FAULT_STEP, "forward")),
    Scenario("kill-backward-z2", 2, Fault(1, FAULT_STEP, "backward")),
    Scenario("kill-step-z1", 1, Fault(1, FAULT_STEP, "step")),
    Scenario("kill-save-z2", 2, Fault(1, 3, "save")),
    Scenario("kill-rank0-forward-z2", 2, Fault(0, FAULT_STEP, "forward")),  # rank 0 also hosts the store
    Scenario("raise-forward-z2", 2, Fault(1, FAULT_STEP, "forward", "raise")),
    Scenario("raise-backward-linger-z3", 3, Fault(1, FAULT_STEP, "backward", "raise"), linger_s=6.0),
    Scenario("stop-forward-3ranks-z2", 2, Fault(2, FAULT_STEP, "forward", "stop"), world_size=3),
    Scenario("stop-forward-busy-z2", 2, Fault(1, FAULT_STEP, "forward", "stop"), busy=True),
]


class BusyAtFault(pl.Callback):
    """The survivors do Python work (no collective) at the fault step, for longer than the watchdog needs."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == FAULT_STEP:
            deadline = time.monotonic() + 4 * BLOCKED_BOUND_S
            while time.monotonic() < deadline:
                pass


def _strategy(stage: int) -> WatchedZero:
    return WatchedZero(stage, failure_timeout_s=TIMEOUT_S, heartbeat_s=HEARTBEAT_S)


def _checkpointing(root: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=root, every_n_train_steps=EVERY, save_last=True, save_top_k=-1)


def _fail(rank: int, world_size: int, scenario: Scenario, root: Path):
    pl.seed_everything(5, verbose=False)
    fault = scenario.fault
    callbacks = [_checkpointing(root)] + ([BusyAtFault()] if scenario.busy and rank != fault.rank else [])
    trainer = make_trainer(_strategy(scenario.stage), world_size, max_steps=STEPS, callbacks=callbacks,
                           enable_checkpointing=True)
    try:
        trainer.fit(FaultyLM(fault, root / "struck_at"))
    except BaseException as err:
        raised_at = time.monotonic()
        if rank == fault.rank:
            time.sleep(scenario.linger_s)
        released = trainer.strategy._runtime is None or trainer.strategy._runtime.released  # teardown ran
        return type(err).__name__, "".join(traceback.format_exception(err)), raised_at, released
    return "finished", "", time.monotonic(), True


@pytest.fixture(scope="module")
def failed_runs(tmp_path_factory):
    """Every scenario, run once: its outcomes (one per rank) and the time the fault struck."""
    runs = {}
    for scenario in SCENARIOS:
        root = tmp_path_factory.mktemp(scenario.name)
        outcomes = launch(partial(_fail, scenario=scenario, root=root), scenario.world_size, timeout_s=60,
                          expendable={scenario.fault.rank})
        runs[scenario.name] = (scenario, root, outcomes, float((root / "struck_at").read_text()))
    return runs


@pytest.mark.parametrize("name", [s.name for s in SCENARIOS])
def test_every_other_rank_fails_quickly_naming_the_failed_rank(failed_runs, name: str) -> None:
    scenario, _, outcomes, struck_at = failed_runs[name]
    failing = scenario.fault.rank
    for outcome in outcomes:
        if outcome.rank == failing:
            # Killed; stopped or lingering (killed by the harness once the others ended); or raised and returned.
            expected = {"kill": -9, "stop": None, "raise": None if scenario.linger_s else 0}[scenario.fault.action]
            assert outcome.exitcode == expected, outcome
            continue
        # Naming the failed rank, and not this one, in the error the rank ended with.
        if scenario.fault.action == "stop" or scenario.linger_s:
            # zero3's survivors wait at the unit-order board, in Python, where their ranks share a host (unit_order.py)
            blocked = not scenario.busy and scenario.stage != 3
            if blocked:  # in a collective gloo cannot interrupt: the watchdog ends the process
                assert outcome.exitcode == EXIT_CODE, outcome
                text, ended = outcome.stderr, outcome.ended
                assert "the training thread is blocked in a collective that cannot be interrupted" in text
            else:  # running Python: PeerFailure is raised there, Lightning's teardown runs, fit raises it
                kind, text, ended, released = outcome.value
                assert kind == "PeerFailure" and released, outcome
            bound = BLOCKED_BOUND_S
        else:
            assert outcome.exitcode == 0 and outcome.value is not None, outcome
            kind, text, ended, released = outcome.value
            # gloo's error, with the watchdog's note; or, when the peer raised, its published failure, which the
            # watchdog thread may deliver (as PeerFailure) while this thread is still unwinding gloo's error. zero3:
            # the unit-order board's, which found the dead peer's process gone (unit_order.py).
            kinds = ("RuntimeError", "CheckpointError") + (("PeerFailure",) if scenario.fault.action == "raise" else ())
            kinds += ("DistNetworkError",) if scenario.stage == 3 else ()
            assert kind in kinds and released, text
            bound = DEAD_BOUND_S
        assert f"rank {failing} " in text and f"rank {outcome.rank} failed" not in text, text
        if scenario.fault.action == "raise":
            assert f"rank {failing} failed: InjectedFailure: injected failure on rank {failing}" in text, text
        elif scenario.fault.action == "stop":
            assert f"rank {failing} sent no heartbeat for 2." in text, text
        elif failing == 0:
            assert "rank 0 is gone: the process group's store, which runs in its process, is unreachable" in text
        else:
            assert f"rank {failing} did not answer a probe within" in text, text
        assert ended - struck_at < bound, (name, outcome.rank, ended - struck_at)


def _uninterrupted(rank: int, world_size: int, stage: int):
    pl.seed_everything(5, verbose=False)
    model = FaultyLM()
    make_trainer(_strategy(stage), world_size, max_steps=STEPS).fit(model)
    return model.losses, flat_params(model)


def _resume(rank: int, world_size: int, scenario: Scenario, root: Path):
    pl.seed_everything(5, verbose=False)
    model = FaultyLM()
    trainer = make_trainer(_strategy(scenario.stage), world_size, max_steps=STEPS, callbacks=[_checkpointing(root)],
                           enable_checkpointing=True)
    trainer.fit(model, ckpt_path="last")
    return model.losses, flat_params(model)


def _resume_all(rank: int, world_size: int, runs: dict):
    scenarios = [(name, scenario, root) for name, (scenario, root, _, _) in runs.items()
                 if scenario.world_size == world_size]
    reference = {stage: _uninterrupted(rank, world_size, stage) for stage in sorted({s.stage for _, s, _ in scenarios})}
    return reference, {name: _resume(rank, world_size, scenario, root) for name, scenario, root in scenarios}


def test_resuming_from_last_after_each_failure_equals_an_uninterrupted_run(failed_runs) -> None:
    for world_size in sorted({s.world_size for s in SCENARIOS}):
        results = launch(partial(_resume_all, runs=failed_runs), world_size, timeout_s=120)
        for outcome in results:
            assert outcome.error is None and outcome.exitcode == 0, (outcome.error, outcome.stderr[-3000:])
            reference, resumed = outcome.value
            for name, (losses, params) in resumed.items():
                scenario = failed_runs[name][0]
                want_losses, want_params = reference[scenario.stage]
                start = scenario.resumed_from
                assert len(losses) == STEPS - start, (name, len(losses))
                assert losses == want_losses[start:], name  # every step after the resume point, bitwise
                assert torch.equal(params, want_params), name
