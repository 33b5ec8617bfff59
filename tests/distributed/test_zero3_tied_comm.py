"""zero3 on a language model with tied input/output embeddings: every parameter is all-gathered once per forward and
once per backward at most, the tied matrix once per step, read from the strategy's own accounting (CommStats).

The tied matrix is used by two modules (the embedding and the output head) and so belongs to the root unit, which is
gathered once for the whole training step (its two uses in forward and its two in backward share that one gather).
The transformer blocks are units: gathered for forward and again for backward (``reshard_after_forward=True``), or
once (``False``). So per step, with padding counted exactly (``ShardSpec.padded_numel``):

    all_gather = (2 * blocks + root) * 4 bytes * (N-1)/N     <= 2 Psi (N-1)/N      (reshard_after_forward=True)
    all_gather = (blocks + root) * 4 bytes * (N-1)/N          = 1 Psi (N-1)/N      (reshard_after_forward=False)

(The first: less the last block's backward gather, which stays gathered from its forward.) And a model run twice
before its backward: the same steps as DDP, the last block freed again by the second forward so that it prefetches.
"""

from __future__ import annotations

from functools import cache

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.sharding.flat_param import ShardSpec
from lightning_zero.sharding.unit_state import UnitState
from tests.harness import run_on_ranks
from tests.models import Recorder, TinyLM, make_trainer

STEPS = 3
VOCAB = 512  # a large tied matrix: the root unit is about half the model


class PerStep(pl.Callback):
    """The strategy's own byte count of every optimizer step (reset at each batch start)."""

    reads_parameters = False

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []

    def on_train_batch_start(self, trainer, *_args) -> None:
        trainer.strategy.comm_stats.reset()

    def on_train_batch_end(self, trainer, *_args) -> None:
        by_op = trainer.strategy.comm_stats.by_op
        self.steps.append({op: s.bytes for op, s in by_op.items()} | {f"{op}_calls": s.calls for op, s in by_op.items()})


class RunTwice(TinyLM):
    """The model run twice before one backward (the sequence and its mirror image), as contrastive objectives do."""

    def training_step(self, batch, batch_idx):
        tokens, _ = batch
        x, targets = tokens[:, :-1], tokens[:, 1:].reshape(-1)
        ce = lambda logits: nn.functional.cross_entropy(logits.reshape(-1, self.vocab), targets)  # noqa: E731
        return (ce(self(x)) + ce(self(x.flip(1)))) / 2


class FirstBlockSees(pl.Callback):
    """At each forward of the first block (after the strategy's pre-forward hook): how many blocks are gathered or on
    their way, and whether the second block is (prefetched)."""

    reads_parameters = False

    def __init__(self) -> None:
        self.seen: list[tuple[int, bool]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        units = trainer.strategy.runtime.parameters.units
        alive = lambda: [u.state is not UnitState.SHARDED for u in units]  # noqa: E731
        units[0].module.register_forward_pre_hook(lambda *_: self.seen.append((sum(alive()), alive()[1])))


def _run(rank: int, world_size: int) -> dict:
    out = {}
    for reshard in (True, False):
        pl.seed_everything(0, verbose=False)
        per_step = PerStep()
        model = TinyLM(vocab=VOCAB, d_model=32, n_layer=2)
        strategy = ZeroStrategy(stage=3, reshard_after_forward=reshard)
        make_trainer(strategy, world_size, max_steps=STEPS, callbacks=[per_step]).fit(model)
        out[reshard] = per_step.steps
    for name, strategy in (("twice", ZeroStrategy(stage=3)), ("twice ddp", DDPStrategy())):
        pl.seed_everything(0, verbose=False)
        # PerStep before Recorder: the recorder's gather of the weights falls outside the step's count.
        per_step, seen, recorder = PerStep(), FirstBlockSees(), Recorder()
        callbacks = [per_step, seen, recorder] if name == "twice" else [recorder]
        make_trainer(strategy, world_size, max_steps=STEPS, callbacks=callbacks,
                     num_sanity_val_steps=0).fit(RunTwice(vocab=VOCAB, d_model=32, n_layer=3))
        out[name] = (recorder.losses, recorder.params, per_step.steps, seen.seen)
    return out


@cache
def results(world_size: int) -> list[dict]:
    return run_on_ranks(_run, world_size)


def _padded(world_size: int) -> tuple[int, int, int, int]:
    """Padded elements of the blocks and of the root unit, Psi (tied matrix once) and the block count."""
    model = TinyLM(vocab=VOCAB, d_model=32, n_layer=2)
    model.configure_model()
    tied = model.lm["head"].weight is model.lm["wte"].weight
    assert tied
    blocks = {p for block in model.lm["blocks"] for p in block.parameters()}
    padded = {p: ShardSpec(p.shape, 0, world_size).padded_numel * world_size for p in model.parameters()}
    psi = sum(p.numel() for p in model.parameters())  # a tied parameter is yielded once
    in_blocks = sum(n for p, n in padded.items() if p in blocks)
    return in_blocks, sum(padded.values()) - in_blocks, psi, len(model.lm["blocks"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero3_gathers_each_parameter_once_per_forward_and_backward(world_size: int) -> None:
    blocks, root, psi, n_blocks = _padded(world_size)
    ring = (world_size - 1) / world_size
    for per_rank in results(world_size):
        assert len(per_rank[True]) == len(per_rank[False]) == STEPS
        for step in per_rank[True]:
            # The last block stays gathered from its forward to its backward (blocks alike), from the first step: the
            # sanity check's validation ran the blocks before it.
            assert step["all_gather"] == round((2 * blocks - blocks // n_blocks + root) * 4 * ring)
            assert step["all_gather_calls"] == 2 * n_blocks - 1 + 1
            assert step["all_gather"] <= round(2 * (blocks + root) * 4 * ring)  # 2 Psi (N-1)/N, padding included
            assert step["all_gather"] >= 2 * psi * 4 * ring * (blocks / (blocks + root))
            assert step["reduce_scatter"] == round((blocks + root) * 4 * ring)  # gradients: once, tied matrix once
        for step in per_rank[False]:
            assert step["all_gather"] == round((blocks + root) * 4 * ring)  # 1 Psi (N-1)/N, padding included
            assert step["all_gather_calls"] == n_blocks + 1
            assert psi * 4 * ring <= step["all_gather"] <= psi * 4 * ring * 1.05


def test_tied_model_is_mostly_root_here() -> None:
    """The figure above is only informative if the tied matrix is a large share of the model."""
    blocks, root, _, _ = _padded(2)
    assert root > 0.4 * (blocks + root)


def test_a_model_run_twice_before_its_backward_prefetches_and_matches_ddp() -> None:
    """The last block is kept gathered after the first forward; the second forward frees it at its first block (so
    that block prefetches the next as in any forward, within ``prefetch=1``: 2 blocks alive) and keeps it again at its
    end. So a steady step gathers the root once, every block in both forwards, and every block but the last in the
    backward; the first step, with no order yet, keeps nothing. (Three blocks: were the last kept through the second
    forward, the first block could not prefetch the second within ``prefetch=1``.)"""
    n_blocks = 3
    for per_rank in results(2):
        losses, params, steps, seen = per_rank["twice"]
        ddp_losses, ddp_params, _, _ = per_rank["twice ddp"]
        assert losses == pytest.approx(ddp_losses, rel=1e-5) and len(losses) == STEPS
        for got, want in zip(params, ddp_params):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert [step["all_gather_calls"] for step in steps] == [1 + 3 * n_blocks] + [1 + 3 * n_blocks - 1] * (STEPS - 1)
        assert seen[0] == (1, False)  # the first forward of all: nothing to prefetch from yet
        assert seen[2:] == [(2, True)] * (2 * STEPS - 2)  # from the second step: the second block prefetched
