"""World size 1 with the collectives really issued (``shortcut_single_rank=False``), against the short cut: the same
code path every rank of a multi-GPU job takes, here over gloo (tests/gpu runs it over NCCL on one GPU). Results must
be bitwise equal, and the forced run must actually have communicated."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import ParityModel, Recorder, StepSeededLM, make_trainer

CASES = [
    (1, "32-true", False),
    (2, "32-true", False),
    (3, "32-true", False),
    (2, "bf16-mixed", False),
    (3, "bf16-mixed", False),
    (2, "32-true", True),  # find_unused_parameters: the flags' all-reduce
    (3, "32-true", True),
]


def _strategy(stage: int, shortcut: bool, unused: bool) -> ZeroStrategy:
    units = {"units": ("Block",)} if stage == 3 and not unused else {}
    return ZeroStrategy(stage=stage, shortcut_single_rank=shortcut, find_unused_parameters=unused, **units)


def _fit(strategy, precision: str, unused: bool, steps: int = 6, ckpt_path=None):
    pl.seed_everything(3, verbose=False)
    model = ParityModel("adamw", with_unused=True) if unused else StepSeededLM()
    recorder = Recorder()
    trainer = make_trainer(strategy, 1, max_steps=steps, callbacks=[recorder], precision=precision,
                           use_distributed_sampler=False)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, recorder


def _run(rank: int, world_size: int, root: Path) -> dict:
    out = {}
    for stage, precision, unused in CASES:
        for shortcut in (True, False):
            trainer, recorder = _fit(_strategy(stage, shortcut, unused), precision, unused)
            out[(stage, precision, unused, shortcut)] = (recorder.params, trainer.strategy.comm_stats.total_calls)
    # A sharded checkpoint saved and loaded with the collectives issued.
    first, _ = _fit(_strategy(3, False, False), "32-true", False, steps=3)
    first.save_checkpoint(root / "forced.ckpt")
    _, resumed = _fit(_strategy(3, False, False), "32-true", False, steps=6, ckpt_path=root / "forced.ckpt")
    out["resume"] = resumed.params
    return out


@lru_cache(maxsize=None)
def results(root: str) -> dict:
    return run_on_ranks(lambda r, w: _run(r, w, Path(root)), 1)[0]


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict:
    return results(str(tmp_path_factory.mktemp("single_rank")))


@pytest.mark.parametrize("stage,precision,unused", CASES)
def test_issued_collectives_change_nothing(outcome: dict, stage: int, precision: str, unused: bool) -> None:
    shortcut_params, shortcut_calls = outcome[(stage, precision, unused, True)]
    forced_params, forced_calls = outcome[(stage, precision, unused, False)]
    assert shortcut_calls == 0 and forced_calls > 0
    assert len(forced_params) == len(shortcut_params) == 6
    for got, want in zip(forced_params, shortcut_params):
        assert torch.equal(got, want)
    assert not torch.equal(forced_params[0], forced_params[-1])


def test_checkpoint_round_trip_with_issued_collectives(outcome: dict) -> None:
    uninterrupted, _ = outcome[(3, "32-true", False, False)]
    for got, want in zip(outcome["resume"], uninterrupted[3:]):
        assert torch.equal(got, want)
