"""zero3 with control flow that differs between ranks: every unit gather is a collective, so a rank that skips a unit
would leave the others waiting (NCCL hangs for the process-group timeout, gloo aborts the process). The ranks check
which unit they move before each unit collective and fail at once, on every rank, naming both units."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import TinyLM, make_trainer


class SkipsABlockOnRank1(TinyLM):
    def forward(self, tokens):
        x = self.lm["wte"](tokens) + self.lm["wpe"](__import__("torch").arange(tokens.shape[1]))
        blocks = self.lm["blocks"] if self.global_rank == 0 else self.lm["blocks"][:1]
        for block in blocks:
            x = block(x)
        return self.lm["head"](self.lm["ln_f"](x))


def _fit(rank: int, world_size: int) -> None:
    pl.seed_everything(1, verbose=False)
    trainer = make_trainer(ZeroStrategy(stage=3, units=("Block",)), world_size, max_steps=2, limit_val_batches=0)
    trainer.fit(SkipsABlockOnRank1())


def test_ranks_running_different_units_fail_fast_naming_both() -> None:
    started = time.perf_counter()
    with pytest.raises(AssertionError) as err:
        run_on_ranks(_fit, 2, timeout_s=60)
    message = str(err.value)
    assert "RankDivergenceError: ranks diverged under zero3" in message
    assert "unit 'lm.blocks.1'" in message and "unit 'lm.blocks.0'" in message
    assert time.perf_counter() - started < 30
