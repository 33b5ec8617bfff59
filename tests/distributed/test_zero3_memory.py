"""What a zero3 rank holds, counted as a user meets it: every tensor alive in the process after a step (found by the
garbage collector, not only those the strategy reports), against ZeRO-3's 16Ψ/N.

The model has a large tied embedding (GPT-2's shape in miniature: the embedding is most of the parameters and sits in
the root unit), which is where an unbounded pool of gather and reduction buffers kept a second and third copy of it;
the pool, bounded within a step, now hands its buffers back at the step's end (tests/distributed/
test_held_after_step.py checks a model of few large units, where two units' buffers were a fifth of the states).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.models import GPTConfig, LanguageModel
from tests.harness import run_on_ranks
from tests.live_tensors import live_tensor_bytes
from tests.models import make_trainer

CONFIG = GPTConfig(vocab_size=16384, n_layer=2, n_head=2, d_model=128, seq_len=16)


class _AfterStep(pl.Callback):
    def __init__(self) -> None:
        self.live: list[int] = []
        self.held = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.held.append(trainer.strategy.model_state_bytes())
        del outputs
        self.live.append(live_tensor_bytes())


def _held_after_steps(rank: int, world_size: int, pool_mb: float | None) -> dict:
    torch.manual_seed(0)
    model = LanguageModel(CONFIG, lr=1e-3, warmup_steps=0)
    tokens = torch.randint(0, CONFIG.vocab_size, (4 * world_size * 3, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    probe = _AfterStep()
    # lean, as where the model states are a large share of the budget ([Note: lean or fast memory])
    strategy = ZeroStrategy(stage=3, units=["Block"], buffer_pool_mb=pool_mb, lean_memory=True)
    trainer = make_trainer(strategy, world_size, max_steps=3, callbacks=[probe])
    baseline = live_tensor_bytes()  # the data set, before anything of the model exists
    trainer.fit(model, train_dataloaders=data)
    pool = strategy.runtime.parameters.pool
    return {"live": [b - baseline for b in probe.live], "held": probe.held, "bound": pool.max_bytes,
            "params": CONFIG.num_parameters}


@pytest.mark.parametrize("pool_mb", [None, 0.0])
def test_zero3_holds_the_formula_after_a_step(pool_mb: float | None) -> None:
    world_size = 2
    for result in run_on_ranks(lambda r, w: _held_after_steps(r, w, pool_mb), world_size):
        formula = 16 * result["params"] / world_size  # fp32 AdamW: params, grads, two moments
        largest_block = 12 * CONFIG.d_model**2 + 13 * CONFIG.d_model
        assert result["bound"] == (2 * 4 * largest_block if pool_mb is None else 0)  # within a step
        for held in result["held"]:
            assert held.buffers == 0  # handed back at the step's end
            assert abs(held.total - formula) <= 0.02 * formula  # padding of at most one row per parameter
        for live in result["live"]:
            # Everything alive in the process (minus the data set): the model states and a few KiB of Lightning's
            # own (metrics, RNG states, the loss).
            assert live <= formula + 256 * 2**10, live / formula
