"""Stages 1 and 2 reduce and gather a large parameter in its own storage (``inplace_mb``): same values and the same
bytes on the wire as packing it into a bucket buffer, and no bucket buffer held for it.

Each layout trains the same model on the same data, 2 ranks, in fp32 and in bf16-mixed with clipping by norm (the
reduction then runs in the 16-bit gradients, the gather writes the cast fp32 masters into the 16-bit parameters).
"""

from __future__ import annotations

from functools import cache

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.sharding.flat_param import ShardSpec
from tests.distributed.test_memory_comm import WIDTH, WideMLP
from tests.harness import run_on_ranks
from tests.models import make_trainer

STEPS = 4
BUCKET_MB = 1.0  # every parameter of WideMLP fits one bucket when packed
LAYOUTS = {"packed": None, "inplace": 0.1}  # MiB: WideMLP's 256x256 weights (0.25 MiB, 0.125 in bf16) go in place


class Record(pl.Callback):
    """Losses, parameters after each step, the strategy's communicated bytes per step, the bytes of the free bucket
    buffers its pool keeps before each backward and before each optimizer step, and where the gradients live: whether
    every ``param.grad`` is None before each backward (Lightning's ``zero_grad`` sets them to None), and before each
    optimizer step whether each one's storage is the one the first step's gradient had (kept alive here, so that an
    allocation could not land at the same address by chance)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.params: list[torch.Tensor] = []
        self.comm: list[tuple[int, int]] = []
        self.pool: dict[str, list[list[int]]] = {"backward": [], "step": []}
        self.grads_none: list[bool] = []
        self.grad_storage_reused: list[list[bool]] = []
        self._first_grads: list[torch.Tensor] = []

    def _pool(self, trainer, when: str) -> None:
        pool = trainer.strategy.runtime.parameters.pool
        self.pool[when].append([b.numel() * b.element_size() for b in pool.buffers()])

    def on_before_backward(self, trainer, pl_module, *_args) -> None:
        self._pool(trainer, "backward")
        self.grads_none.append(all(p.grad is None for p in pl_module.parameters()))

    def on_before_optimizer_step(self, trainer, pl_module, *_args) -> None:
        self._pool(trainer, "step")
        grads = [p.grad for p in pl_module.parameters()]
        if not self._first_grads:
            self._first_grads = grads
        pointers = [g.untyped_storage().data_ptr() for g in self._first_grads]
        self.grad_storage_reused.append([g.untyped_storage().data_ptr() == p for g, p in zip(grads, pointers)])

    def on_train_batch_start(self, trainer, *_args) -> None:
        trainer.strategy.comm_stats.reset()

    def on_train_batch_end(self, trainer, pl_module, outputs, *_args) -> None:
        self.losses.append(float(outputs["loss"]))
        with trainer.strategy.gathered_parameters():
            self.params.append(torch.cat([p.detach().float().reshape(-1) for p in pl_module.parameters()]))
        by_op = trainer.strategy.comm_stats.by_op
        self.comm.append((by_op["reduce_scatter"].bytes, by_op["all_gather"].bytes))


def _run(rank: int, world_size: int) -> dict:
    out = {}
    for precision in ("32-true", "bf16-mixed"):
        for stage in (1, 2):
            for layout, inplace_mb in LAYOUTS.items():
                pl.seed_everything(0, verbose=False)
                record = Record()
                # lean: the pool hands its buffers back once the gathers complete ([Note: lean or fast memory])
                strategy = ZeroStrategy(stage, bucket_mb=BUCKET_MB, inplace_mb=inplace_mb, lean_memory=True)
                trainer = make_trainer(strategy, world_size, max_steps=STEPS, callbacks=[record], precision=precision,
                                       gradient_clip_val=0.5)
                trainer.fit(WideMLP())
                params = trainer.strategy.runtime.parameters
                names = [name for name, _ in trainer.lightning_module.named_parameters()]
                gather_order = [names.index(bucket.shards[0].name) for bucket in params._order]
                out[(precision, stage, layout)] = (record.losses, record.params, record.comm, record.pool, gather_order,
                                                   record.grads_none, record.grad_storage_reused)
    return out


@cache
def results() -> list[dict]:
    return run_on_ranks(_run, 2)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("stage", [1, 2])
def test_inplace_layout_trains_exactly_like_the_packed_one(precision: str, stage: int) -> None:
    for per_rank in results():
        losses, params, comm, *_ = per_rank[(precision, stage, "inplace")]
        packed_losses, packed_params, packed_comm, *_ = per_rank[(precision, stage, "packed")]
        assert len(params) == STEPS
        # Two ranks sum the same two numbers either way: bitwise equal, in fp32 and in bf16.
        assert losses == packed_losses
        assert all(torch.equal(a, b) for a, b in zip(params, packed_params))
        assert not torch.equal(params[0], params[-1])
        assert comm == packed_comm  # the same bytes, in more and smaller collectives


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("stage", [1, 2])
def test_inplace_layout_holds_no_bucket_buffer_for_the_large_parameters(precision: str, stage: int) -> None:
    itemsize = 4 if precision == "32-true" else 2
    weight = WIDTH * WIDTH  # the three large weights
    small = sum(ShardSpec(p.shape, 0, 2).padded_numel * 2 for p in WideMLP().parameters() if p.numel() != weight)
    for per_rank in results():
        packed_pool = per_rank[(precision, stage, "packed")][3]
        inplace_pool = per_rank[(precision, stage, "inplace")][3]
        # After the backward's reductions the pool keeps their buffer for the gathers after the step. Packed: the
        # bucket holding the whole model. In place: only the bucket of the small parameters (biases, the
        # LayerNorm, the 3-row head, padded to 4 rows).
        assert packed_pool["step"] == [[(3 * weight + small) * itemsize]] * STEPS
        assert inplace_pool["step"] == [[small * itemsize]] * STEPS
        # Once the gathers have completed in the forward, it keeps nothing: the activations can use that memory.
        assert packed_pool["backward"] == inplace_pool["backward"] == [[]] * STEPS


def test_inplace_layout_gathers_in_the_order_the_forward_uses_the_parameters() -> None:
    # The packed bucket of small parameters stays open across the large ones, but is gathered where its first
    # parameter (the first Linear's bias) is: before the second weight, not after the last one.
    for per_rank in results():
        order = per_rank[("32-true", 1, "inplace")][4]
        assert len(order) == 4 and order == sorted(order)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("stage", [1, 2])
def test_gradients_reuse_their_memory_across_steps(stage: int, layout: str) -> None:
    # Lightning's zero_grad(set_to_none=True) drops every gradient before each backward, yet each backward's
    # gradients land in the memory the first step's had: under stage 2 the persistent shard buffers, under stage 1
    # the full gradients, lent back as each gradient arrives (grad_hooks.py, [Note: stage 1 reuses its full
    # gradients' memory]).
    n_params = len(list(WideMLP().parameters()))
    for precision in ("32-true", "bf16-mixed"):
        for per_rank in results():
            grads_none, reused = per_rank[(precision, stage, layout)][5:]
            assert grads_none == [True] * STEPS
            assert reused == [[True] * n_params] * STEPS
