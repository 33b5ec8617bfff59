"""fp32 parity with DDP, every step: losses and all parameters, zero1 and zero2, at 2 and 4 ranks.

All cases of one world size run in one fork of N ranks; each case trains the same model on the same data with
Lightning's DDP and with ``Trainer(strategy="zero1"/"zero2")`` and records the loss and every parameter after each
optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import ParityModel, Recorder, make_trainer

STEPS = 10
# 1e-5 relative, with an absolute floor for elements near zero; measured differences are at most ~2.4e-7 (4 ranks,
# where gloo's all-reduce sums in another order than DDP's buckets) and exactly 0 at 2 ranks.
RTOL, ATOL = 1e-5, 1e-6


@dataclass(frozen=True)
class Case:
    optimizer: str = "adamw"
    accumulate: int = 1
    with_unused: bool = False

    @property
    def id(self) -> str:
        return f"{self.optimizer}-acc{self.accumulate}" + ("-unused" if self.with_unused else "")


CASES = [Case("adamw"), Case("sgd"), Case("groups_sched"), Case("adamw", accumulate=2), Case("adamw", with_unused=True)]
STAGES = (1, 2)
#: "default": this model's parameters are all below ``inplace_mb``, so packed into buckets; "inplace": a tiny
#: ``inplace_mb`` reduces and gathers every evenly split parameter in its own storage (the padded ones still packed).
LAYOUTS = ("default", "inplace")
INPLACE_MB = 1e-6


def _fit(strategy, case: Case, world_size: int) -> Recorder:
    pl.seed_everything(1234, verbose=False)
    recorder = Recorder()
    model = ParityModel(case.optimizer, with_unused=case.with_unused)
    trainer = make_trainer(
        strategy, world_size, max_steps=STEPS, callbacks=[recorder], accumulate_grad_batches=case.accumulate
    )
    trainer.fit(model)
    return recorder


def _run_all(rank: int, world_size: int) -> dict:
    out = {}
    for case in CASES:
        ddp = DDPStrategy(find_unused_parameters=case.with_unused)
        out[(case, "ddp")] = _fit(ddp, case, world_size)
        for stage in STAGES:
            strategy = ZeroStrategy(stage, find_unused_parameters=True) if case.with_unused else f"zero{stage}"
            out[(case, stage)] = _fit(strategy, case, world_size)
            inplace = ZeroStrategy(stage, find_unused_parameters=case.with_unused, inplace_mb=INPLACE_MB)
            out[(case, stage, "inplace")] = _fit(inplace, case, world_size)
    return {key: (rec.losses, rec.params) for key, rec in out.items()}


@lru_cache(maxsize=None)
def results(world_size: int) -> list[dict]:
    return run_on_ranks(_run_all, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_ddp_every_step(world_size: int, stage: int, case: Case, layout: str) -> None:
    for rank, per_rank in enumerate(results(world_size)):
        ddp_losses, ddp_params = per_rank[(case, "ddp")]
        losses, params = per_rank[(case, stage) if layout == "default" else (case, stage, layout)]
        assert len(params) == len(ddp_params) == STEPS
        assert len(losses) == STEPS * case.accumulate
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=RTOL, atol=ATOL)
        for step, (got, want) in enumerate(zip(params, ddp_params)):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {rank} step {step}: {m}")
        # The run must actually train: parameters move away from their initial values.
        assert not torch.allclose(params[0], params[-1])


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_hold_identical_parameters(world_size: int) -> None:
    per_rank = results(world_size)
    for stage in STAGES:
        for case in CASES:
            first = per_rank[0][(case, stage)][1][-1]
            for other in per_rank[1:]:
                assert torch.equal(other[(case, stage)][1][-1], first)
