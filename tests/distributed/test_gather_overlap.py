"""zero1/zero2 leave the post-step parameter all-gather in flight, to complete during the next forward (see [Note:
the parameter all-gather overlaps the next forward] in sharding/replicated.py), and still train exactly as DDP. This
small model's buckets would hold more than 1/16 of its parameters, so by default its gathers complete before the
step returns ([Note: what the gathers in flight hold]): ``overlap_gather=True`` keeps them in flight here.

The model reads parameters in every way that does not go through their module's forward: a position embedding
indexed directly (its module is never called), the LightningModule's own parameter, and a tied weight used with
``F.linear``. The callbacks that record the run declare ``reads_parameters = False`` so that nothing forces the
gathers to complete between steps: the losses (computed by forwards that ran while gathers were in flight) must
equal DDP's every step, and the parameters after ``fit`` too. A callback that reads parameters in
``on_train_batch_end`` without declaring anything sees them complete (the gate waits for it).
"""

from __future__ import annotations

from functools import cache

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import Block, make_trainer, token_dataset

STEPS = 6
RTOL, ATOL = 1e-5, 1e-6


class DirectReads(pl.LightningModule):
    def __init__(self, vocab: int = 11, d: int = 16, seq: int = 6) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, n_head=2) for _ in range(2))
        # Registered last, so gathered last, yet read first: only the read guard completes them in time.
        self.pos = nn.Embedding(seq, d)  # never called: its weight is indexed directly
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return F.linear(x, self.wte.weight) / self.temperature  # tied output projection

    def training_step(self, batch, batch_idx):
        tokens, _ = batch
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(token_dataset(), batch_size=4, shuffle=False)


class Losses(pl.Callback):
    """Losses per step, and whether the gathers were still in flight when the step's hooks ran."""

    reads_parameters = False

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.in_flight: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, *_args) -> None:
        self.losses.append(float(outputs["loss"]))
        params = getattr(getattr(trainer.strategy, "runtime", None), "parameters", None)
        self.in_flight.append(bool(getattr(params, "in_flight", False)))


class ReadsParameters(pl.Callback):
    """An EMA-like callback: reads every parameter after each step, declaring nothing."""

    def __init__(self) -> None:
        self.sums: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *_args) -> None:
        self.sums.append(float(sum(p.detach().double().sum() for p in pl_module.parameters())))


def _fit(strategy, reader: bool):
    pl.seed_everything(7, verbose=False)
    losses = Losses()
    callbacks = [losses] + ([ReadsParameters()] if reader else [])
    model = DirectReads()
    make_trainer(strategy, 2, max_steps=STEPS, callbacks=callbacks).fit(model)
    final = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    return losses, callbacks[-1], final


def _fit_compiled(strategy):
    pl.seed_everything(7, verbose=False)
    losses = Losses()
    make_trainer(strategy, 2, max_steps=STEPS, callbacks=[losses]).fit(torch.compile(DirectReads(), backend="eager"))
    return losses, None, torch.zeros(0)


def _run(rank: int, world_size: int) -> dict:
    out = {"ddp": _fit(DDPStrategy(), reader=True)}
    overlap = dict(bucket_mb=0.002, overlap_gather=True)  # several buckets, left in flight
    out["compiled"] = _fit_compiled(ZeroStrategy(stage=2, **overlap))
    for stage in (1, 2):
        out[stage] = _fit(ZeroStrategy(stage=stage, **overlap), reader=False)
        out[stage, "reader"] = _fit(ZeroStrategy(stage=stage, **overlap), reader=True)
        # Every evenly split parameter (``pos`` included) gathered straight into its own storage while in flight.
        out[stage, "inplace"] = _fit(ZeroStrategy(stage=stage, inplace_mb=1e-6, **overlap), reader=False)
    return {k: (v[0].losses, v[0].in_flight, getattr(v[1], "sums", None), v[2]) for k, v in out.items()}


@cache
def results() -> list[dict]:
    return run_on_ranks(_run, 2)


@pytest.mark.parametrize("layout", ["packed", "inplace"])
@pytest.mark.parametrize("stage", [1, 2])
def test_forwards_with_gathers_in_flight_match_ddp(stage: int, layout: str) -> None:
    for per_rank in results():
        ddp_losses, _, _, ddp_final = per_rank["ddp"]
        losses, in_flight, _, final = per_rank[stage] if layout == "packed" else per_rank[stage, layout]
        assert all(in_flight), "nothing declared to read parameters: the gathers stay in flight past the step"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(final, ddp_final, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_callback_reading_parameters_sees_them_complete(stage: int) -> None:
    for per_rank in results():
        _, _, ddp_sums, _ = per_rank["ddp"]
        _, in_flight, sums, _ = per_rank[stage, "reader"]
        assert not any(in_flight)  # the gate completed them before any callback ran
        torch.testing.assert_close(torch.tensor(sums), torch.tensor(ddp_sums), rtol=1e-6, atol=1e-6)


def test_a_compiled_model_completes_the_gathers_before_training_step() -> None:
    for per_rank in results():
        ddp_losses = per_rank["ddp"][0]
        losses, in_flight, _, _ = per_rank["compiled"]
        assert all(in_flight)  # in flight past the step, completed before the compiled forward
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=RTOL, atol=ATOL)
