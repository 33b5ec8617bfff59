"""Gradient reduction during backward: post-accumulate-grad hooks -> bucket -> reduce-scatter -> local grad shard.

[Note: bucket order and unused parameters]
Buckets are built in the reverse order of ``module.parameters()`` (roughly the order backward produces gradients,
as in ``DistributedDataParallel``). A bucket is launched when all its parameters' gradients are ready, but never
before the buckets in front of it: every rank therefore issues the same collectives in the same order even when
ranks take different control flow. At the end of backward every bucket not yet launched is launched, with zeros
for parameters that got no gradient, so a parameter unused on some ranks (or on all) is reduced consistently and
nothing hangs.

[Note: stage 1 versus stage 2 gradients]
Stage 1 keeps full gradients, as DDP does: micro-batches accumulate into ``param.grad`` with no communication, and
at the accumulation boundary each bucket is reduce-scattered and the averaged owned rows are written back into
``param.grad`` (the optimizer's shard gradient is a view of those rows; the other rows are zeroed so that any
``zero_grad`` leaves a clean gradient). Stage 2 reduces on every backward, accumulates the averaged rows into a
persistent shard-sized buffer, and frees each full gradient as soon as its bucket is packed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_zero.sharding.collectives import MAX_IN_FLIGHT, Collectives, Handle
from lightning_zero.sharding.flat_param import FlatLayout, ParamShard, group_into_buckets



class _Bucket:
    def __init__(self, index: int, shards: Sequence[ParamShard]) -> None:
        self.index = index
        self.shards = list(shards)
        self.layout = FlatLayout([s.spec for s in shards])
        self.ready = [False] * len(self.shards)
        self.used_anywhere = [True] * len(self.shards)

    @property
    def complete(self) -> bool:
        return all(self.ready)


class GradReducer:
    """Reduce-scatters the gradients of ``shards`` bucket by bucket; subclasses decide where the result is kept."""

    #: Whether Lightning's ``block_backward_sync`` (gradient accumulation) may defer reduction to the boundary.
    defers_during_accumulation: bool = False

    def __init__(
        self,
        shards: Sequence[ParamShard],
        comms: Collectives,
        bucket_bytes: int,
        find_unused_parameters: bool = False,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.comms = comms
        self.find_unused_parameters = find_unused_parameters
        self.reduce_dtype = reduce_dtype
        self._warned_unused = False
        trainable = [s for s in reversed(shards) if s.trainable]
        self.buckets = [_Bucket(i, b) for i, b in enumerate(group_into_buckets(trainable, bucket_bytes))]
        self._in_flight: deque[tuple[_Bucket, Tensor, Handle]] = deque()
        self._next_launch = 0
        self._started = False
        self.sync = True
        self._hooks = []
        for bucket in self.buckets:
            for position, shard in enumerate(bucket.shards):
                hook = self._make_hook(bucket, position)
                self._hooks.append(shard.full.register_post_accumulate_grad_hook(hook))

    def _make_hook(self, bucket: _Bucket, position: int):
        def hook(_param: Tensor) -> None:
            self._on_grad_ready(bucket, position)

        return hook

    @property
    def active(self) -> bool:
        return self.sync or not self.defers_during_accumulation

    def _on_grad_ready(self, bucket: _Bucket, position: int) -> None:
        if not self.active:
            return
        self._started = True
        bucket.ready[position] = True
        if self.find_unused_parameters:
            return
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
            self._launch(self.buckets[self._next_launch])

    def _dtype(self, bucket: _Bucket) -> torch.dtype:
        return self.reduce_dtype or bucket.shards[0].full.dtype

    def _launch(self, bucket: _Bucket) -> None:
        first = bucket.shards[0].full
        buffer = torch.empty(bucket.layout.full_numel, dtype=self._dtype(bucket), device=first.device)
        bucket.layout.pack([s.full.grad for s in bucket.shards], buffer)
        self._after_pack(bucket)
        segment, handle = self.comms.reduce_scatter_mean(buffer)
        self._in_flight.append((bucket, segment, handle))
        self._next_launch += 1
        while len(self._in_flight) > MAX_IN_FLIGHT:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        bucket, segment, handle = self._in_flight.popleft()
        handle.wait()
        reduced = bucket.layout.local_views(segment)
        keep = bucket.used_anywhere if self.find_unused_parameters else [True] * len(bucket.shards)
        self._store([s for s, k in zip(bucket.shards, keep) if k], [r for r, k in zip(reduced, keep) if k], bucket)

    def finish(self, backward_ran: bool = True) -> None:
        """Reduce what is left of this backward and wait for all of it.

        ``backward_ran=True`` (from the strategy's ``post_backward``, which every rank reaches) reduces every bucket
        even if no hook fired on this rank; ``False`` (before an optimizer step) only completes a started reduction.
        """
        if not self.active or not (self._started or backward_ran):
            return
        if self.find_unused_parameters:
            self._agree_on_used()
        elif not self._warned_unused:
            self._warn_unused()
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        while self._in_flight:
            self._complete_oldest()
        for bucket in self.buckets:
            bucket.ready = [False] * len(bucket.shards)
        self._next_launch = 0
        self._started = False

    def _agree_on_used(self) -> None:
        flags = torch.tensor([float(r) for b in self.buckets for r in b.ready])
        self.comms.all_reduce_sum_(flags)
        used = (flags > 0).tolist()
        for bucket in self.buckets:
            bucket.used_anywhere, used = used[: len(bucket.shards)], used[len(bucket.shards) :]

    def _warn_unused(self) -> None:
        unused = [s.name for b in self.buckets for s, r in zip(b.shards, b.ready) if not r]
        if unused:
            self._warned_unused = True
            rank_zero_warn(
                f"{len(unused)} parameter(s) got no gradient in a backward (e.g. "
                f"{unused[:3]}); they are reduced as zeros, so the optimizer still steps them. Pass "
                "find_unused_parameters=True to skip parameters that no rank used, as DDP does."
            )

    def prepare_backward(self) -> None:
        """Called before every backward; see subclasses."""

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _after_pack(self, bucket: _Bucket) -> None:
        """Called once a bucket's gradients are copied into its flat buffer."""

    def _store(self, shards: list[ParamShard], reduced: list[Tensor], bucket: _Bucket) -> None:
        """Keep the averaged owned rows ``reduced`` of ``shards`` (those of ``bucket`` that someone used)."""
        raise NotImplementedError

    def grad_buffers(self) -> list[Tensor]:
        """Persistent gradient storage owned by the reducer (for memory accounting)."""
        return []


class FullGradReducer(GradReducer):
    """Stage 1: full gradients kept and accumulated locally; reduced at the accumulation boundary."""

    defers_during_accumulation = True

    def __init__(self, shards: Sequence[ParamShard], comms: Collectives, bucket_bytes: int, **kwargs) -> None:
        super().__init__(shards, comms, bucket_bytes, **kwargs)
        self._holds_reduced = False

    def _store(self, shards: list[ParamShard], reduced: list[Tensor], bucket: _Bucket) -> None:
        for shard, rows in zip(shards, reduced):
            grad = shard.full.grad
            if grad is None:
                grad = shard.full.grad = torch.zeros_like(shard.full)
            lo, hi = shard.spec.owned_rows()
            table = grad.view(shard.spec.rows, -1)
            table[:lo].zero_()
            table[hi:].zero_()
            owned = shard.spec.local_view(grad)
            owned.copy_(rows)
            shard.set_grad(owned)
        self._holds_reduced = True

    def prepare_backward(self) -> None:
        """Make ``param.grad`` hold only unreduced local gradient again before autograd accumulates into it.

        After a reduction the full gradient holds the averaged owned rows (zeros elsewhere). If the optimizer's
        ``zero_grad`` dropped the reduced gradient, the full one goes too. If it was zeroed in place, the rows are
        already zero. If it was kept, the rows are scaled by ``N`` so that the next average adds exactly the new
        gradients to them, as DDP's all-reduce of an accumulated gradient does.
        """
        if not self._holds_reduced:
            return
        for bucket in self.buckets:
            for shard in bucket.shards:
                if shard.grad is None:
                    shard.full.grad = None
                else:
                    shard.grad.mul_(self.comms.world_size)
        self._holds_reduced = False


class ShardGradReducer(GradReducer):
    """Stage 2: only the local gradient shard persists; full gradients are freed as soon as they are packed."""

    def __init__(self, shards: Sequence[ParamShard], comms: Collectives, bucket_bytes: int, **kwargs) -> None:
        super().__init__(shards, comms, bucket_bytes, **kwargs)
        self._segments: list[Tensor | None] = [None] * len(self.buckets)

    def _after_pack(self, bucket: _Bucket) -> None:
        for shard in bucket.shards:
            shard.full.grad = None

    def _store(self, shards: list[ParamShard], reduced: list[Tensor], bucket: _Bucket) -> None:
        index = bucket.index
        if self._segments[index] is None:
            device = bucket.shards[0].full.device
            self._segments[index] = torch.zeros(bucket.layout.segment_numel, dtype=self._dtype(bucket), device=device)
        destination = dict(zip(bucket.shards, bucket.layout.local_views(self._segments[index])))
        for shard, rows in zip(shards, reduced):
            if shard.grad is None:
                dst = destination[shard]
                dst.copy_(rows)
                shard.set_grad(dst)
            else:
                shard.grad.add_(rows)

    def grad_buffers(self) -> list[Tensor]:
        return [s for s in self._segments if s is not None]
