"""World size 1: nothing to shard, so nothing to pay. The shortest path every stage takes on one rank with the short
cut on (``shortcut_single_rank=True``, the default) and no offload.

[Note: the world-size-1 path]
With one rank, a reduction is the identity and a gather copies a shard onto itself. So no gradient hook, no
forward hook, no bucket and no pack or unpack copy is installed at all: the parameters stay whole (stage 3
included; see [Note: shards at world size 1] in shards.py), autograd's own gradient in ``param.grad`` *is* the
reduced gradient shard (its local shape is the full shape), and the optimizer steps the shards exactly as on many
ranks. The one copy left is the one mixed precision implies: after an update, the fp32 masters are written into
the 16-bit working parameters (one fused ``_foreach_copy_``); in full precision a shard is a view of its parameter
and the update needs no copy at all. The API, the step's arithmetic (clipping, the non-finite policy, the fp16 loss
scale) and the checkpoint format are the same as on many ranks.

Two semantics of many ranks are kept on purpose: a trainable parameter that got no gradient in a backward is stepped
with a zero gradient unless ``find_unused_parameters=True`` (as the reducers do), and stage 1's ``no_sync`` defers
nothing because there is nothing to defer. Not kept: ``reduce_dtype="fp32"`` has no reduction to run in fp32, so
16-bit gradients accumulate across micro-batches in their own dtype, as on a single device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor

from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.grad_hooks import warn_unused


class SingleRank:
    """Both roles of the runtime at world size 1: ``parameters`` (full, rebuilt from masters after an update) and
    ``gradients`` (autograd's own), with no hooks (see [Note: the world-size-1 path])."""

    def __init__(self, shards: Sequence[ParamShard], find_unused_parameters: bool) -> None:
        self.shards = list(shards)
        self.find_unused_parameters = find_unused_parameters
        self._warned_unused = False

    # ------------------------------------------------------------------------------------------------ gradients

    def pre_backward(self) -> None:
        """Nothing to carry: autograd accumulates into ``param.grad`` itself."""

    def post_backward(self) -> None:
        """A trainable parameter no backward reached is stepped with zeros, as the reducers do on many ranks."""
        if self.find_unused_parameters:
            return
        missing = [s for s in self.shards if s.trainable and s.param.is_floating_point() and s.param.grad is None]
        if not missing:
            return
        if not self._warned_unused:
            self._warned_unused = True
            warn_unused([s.name for s in missing], rank=0)
        for shard in missing:
            shard.param.grad = torch.zeros_like(shard.param)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def kept_buffers(self) -> list[Tensor]:
        """No buffers: nothing is moved."""
        return []

    def grad_buffers(self) -> list[Tensor]:
        return []

    # ----------------------------------------------------------------------------------------------- parameters

    @torch.no_grad()
    def gather(self, shards: Sequence[ParamShard]) -> None:
        """Write the masters of ``shards`` into their working parameters where they are separate tensors."""
        separate = [s for s in shards if s.local.data_ptr() != s.param.data_ptr() or s.local.dtype != s.param.dtype]
        if separate:
            torch._foreach_copy_([s.param.data for s in separate], [s.local.view(s.spec.shape) for s in separate])
        for shard in shards:
            shard.mark_written()

    def after_update(self, stepped: Sequence[ParamShard], defer: bool = False) -> None:
        self.gather(stepped)

    def begin_step(self) -> None:
        """Nothing to gather."""

    def end_step(self) -> None:
        """Nothing to free."""

    def wait(self) -> None:
        """Nothing in flight."""

    def reading_guard(self):
        return nullcontext()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        yield

    def remove(self) -> None:
        """No hooks to remove."""
