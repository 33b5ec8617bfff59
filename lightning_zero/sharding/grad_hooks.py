"""Gradient reduction: where reduced gradient shards live (``GradShards``), and stages 1 and 2's pipeline
(``GradReducer``): post-accumulate-grad hooks -> buckets -> reduce-scatter -> gradient shard in ``param.grad``.
Stage 3 reduces per unit instead (param_hooks.py), into the same ``GradShards``.

[Note: bucket order and unused parameters]
Buckets are built over the parameters that require a gradient, in the reverse order of ``module.parameters()``
(roughly the order backward produces gradients, as in ``DistributedDataParallel``). A bucket is launched when all its
parameters' gradients are ready, but never before the buckets in front of it: every rank therefore issues the same
collectives in the same order even when ranks take different control flow. When backward ends every bucket not yet
launched is launched, with zeros for parameters that got no gradient, so a parameter unused on some ranks (or on all)
is reduced consistently and nothing hangs. Which parameters require a gradient may change between backward passes
(Lightning's ``toggle_optimizer``, ``BaseFinetuning``): the bucket plan is looked up per backward by that set, and
every rank changes it the same way.

[Note: stage 1 versus stage 2 gradients]
Stage 1 keeps full gradients, as DDP does: micro-batches accumulate into ``param.grad`` with no communication (inside
``no_sync``), and at the accumulation boundary each bucket is reduce-scattered and the averaged owned rows are
written into the full gradient's own rows, which ``param.grad`` then shows (a view; see [Note: the reduced gradient
lives in param.grad]). Stage 2 reduces on every backward, adds the averaged rows into a persistent shard-sized buffer
per parameter, and frees each full gradient as soon as its bucket is packed. A large gradient is not packed: it is
its own bucket and is reduced in place (see [Note: a large parameter is its own buffer]). At most ``MAX_IN_FLIGHT``
reductions that hold memory until they complete (a pool buffer, under stage 2 a full gradient, the reduced segment
on NCCL or the segments received on gloo) are pending at once, so the transient memory of reductions is at most that
many buckets' (or large parameters').
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor

from lightning_zero.config import GRAD_QUANTIZATIONS, CommConfig
from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.in_flight import BufferPool, InFlight
from lightning_zero.sharding.buckets import Bucket, make_buckets
from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.quantize import BlockFormat


#: Makes what user code sees as ``param.grad`` from a shard's reduced rows.
HandOut = Callable[[ParamShard, Tensor], Tensor]


class GradHooks:
    """A post-accumulate-grad hook on every parameter that requires a gradient, calling ``on_ready(shard)``, and, if
    given, a hook calling ``on_arriving(shard, grad)`` as each gradient is computed, before it is accumulated: what it
    returns, if not ``None``, is accumulated instead of ``grad``.

    torch only hooks tensors that require a gradient, and a frozen parameter may be unfrozen later (``BaseFinetuning``,
    ``toggle_optimizer``): ``cover`` is called again before every backward and hooks the newly trainable ones.
    """

    def __init__(
        self, on_ready: Callable[[ParamShard], None],
        on_arriving: Callable[[ParamShard, Tensor], Tensor | None] | None = None,
    ) -> None:
        self.on_ready = on_ready
        self.on_arriving = on_arriving
        self._handles: dict[ParamShard, list[Any]] = {}

    def cover(self, shards: Iterable[ParamShard]) -> None:
        for shard in shards:
            if shard not in self._handles and shard.param.requires_grad:
                handles = [shard.param.register_post_accumulate_grad_hook(_calling(self.on_ready, shard))]
                if self.on_arriving is not None:
                    handles.append(shard.param.register_hook(partial(self.on_arriving, shard)))
                self._handles[shard] = handles

    def remove(self) -> None:
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles.clear()


class ShardStorage:
    """Where stages 2 and 3 keep each parameter's reduced gradient shard: a tensor per shard, in memory (this class)
    or elsewhere (disk offload on a host keeps them in files: ``lightning_zero.offload.disk``)."""

    def make(self, shard: ParamShard, like: Tensor) -> Tensor:
        """A persistent tensor of ``like``'s shape and dtype for ``shard``'s gradient rows."""
        return torch.empty_like(like)

    def put(self, destination: Tensor, rows: Tensor, accumulate: bool) -> None:
        """Write ``rows`` into ``destination``, or add them to what it holds."""
        if accumulate:
            destination.add_(rows)
        else:
            destination.copy_(rows)


class GradShards:
    """The reduced gradient shards of a module between backward and step, with ``zero_grad``'s meaning.

    After a reduction each shard's ``param.grad`` shows its reduced rows (see [Note: the reduced gradient lives in
    param.grad]). ``take`` (before a backward) moves those the user did not drop out of autograd's way, so that the
    next reduction adds onto them; ``settle`` (after it) puts back those that no reduction touched.
    ``keep_full_grads`` (stage 1) shows a view of the full gradient's own rows; otherwise the rows live in a
    persistent shard-sized buffer per parameter.

    [Note: stage 1 reuses its full gradients' memory]
    Stage 1's full gradients are model state (one per parameter, as under DDP), yet ``zero_grad(set_to_none=True)``,
    Lightning's default, drops them every step, and autograd allocated them again in the next backward. That sent
    tens of MB through the host allocator each step, and glibc's heap kept more of it than it returned: on the long
    sequence (M-seq1024-2) zero1's training peak RSS read 470-490 MB per rank, against 429-437 MB with the gradients
    kept (BENCHMARKS.md findings). So a dropped full gradient is kept as a spare and lent back as the next gradient of
    its parameter arrives (``lend_spare``): the arriving gradient is copied into it, and autograd, which takes a
    gradient it alone holds as ``param.grad`` without a copy, keeps the spare; the arriving one is freed at once, as
    any temporary of the backward. (Lending it zeroed for autograd to add into took two passes over the gradients
    more than this one, a zeroing and an addition that reads twice: 272 against 262 ms of CPU a step per rank at M-2,
    both in one run.) A parameter that gets no gradient keeps ``None``, as before. As with DDP's
    ``gradient_as_bucket_view``, a reference to an old ``param.grad`` kept past ``zero_grad`` sees the next step's
    gradient.
    """

    def __init__(self, world_size: int, keep_full_grads: bool, storage: ShardStorage | None = None,
                 hand_out: HandOut | None = None) -> None:
        self.world_size = world_size
        self.keep_full_grads = keep_full_grads
        self.storage = storage or ShardStorage()
        #: What user code is given as ``param.grad`` for a shard's reduced rows (user_view.py: a ``ShardedGrad``).
        self.hand_out = hand_out
        self._given: dict[ParamShard, Tensor] = {}
        self._shown: dict[ParamShard, Tensor] = {}
        self._held: dict[ParamShard, Tensor] = {}
        self._full: dict[ParamShard, Tensor] = {}
        self._storage: dict[ParamShard, Tensor] = {}
        self._spare: dict[ParamShard, Tensor] = {}

    def take(self) -> None:
        """Before a backward: carry the shards still in ``param.grad`` into it (``zero_grad`` drops them)."""
        for shard, given in self._given.items():
            full = self._full.pop(shard, None)
            if shard.param.grad is not self._shown[shard]:  # dropped by zero_grad(set_to_none=True), or replaced
                if full is not None:
                    self._spare[shard] = full
                continue
            self._held[shard] = given
            shard.param.grad = self._full_holding(shard, full, given) if self.keep_full_grads else None
        self._given.clear()
        self._shown.clear()

    def lend_spare(self, shard: ParamShard, grad: Tensor) -> Tensor | None:
        """Stage 1, as ``grad`` arrives for ``shard``'s parameter: if the parameter has no gradient, its dropped full
        gradient holding a copy of ``grad``, for autograd to take as ``param.grad`` (see [Note: stage 1 reuses its
        full gradients' memory]); ``None`` leaves ``grad`` to autograd."""
        spare = self._spare.get(shard)
        if (spare is None or shard.param.grad is not None or torch.is_grad_enabled()  # create_graph: autograd's way
                or spare.shape != grad.shape or spare.dtype != grad.dtype or grad.layout != torch.strided):
            return None
        del self._spare[shard]
        # A tensor of its own on the spare's memory: autograd takes a gradient without a copy only if nothing else
        # holds it, and user code may still hold the old ``param.grad``.
        return spare.detach().copy_(grad)

    def _full_holding(self, shard: ParamShard, full: Tensor, rows: Tensor) -> Tensor:
        """Stage 1: the full gradient whose own rows are ``N`` times the reduced rows and whose other rows are zero,
        so that the next average adds exactly the new gradients to them."""
        for other in shard.spec.other_rows(full):
            other.zero_()
        rows.mul_(self.world_size)
        return full

    @torch.no_grad()
    def store(self, shard: ParamShard, rows: Tensor, full: Tensor | None = None) -> None:
        """Keep the averaged rows of ``shard`` (stage 1: in ``full``, the gradient that was reduced)."""
        if self.keep_full_grads:
            if full is None:
                full = torch.zeros_like(shard.param)
            self._full[shard] = full
            destination = shard.spec.local_view(full)
            if destination.data_ptr() != rows.data_ptr():  # reduced in place: the rows are already there
                destination.copy_(rows)
        else:
            destination = self._storage.get(shard)
            if destination is None or destination.dtype != rows.dtype:
                destination = self._storage[shard] = self.storage.make(shard, rows)
            self.storage.put(destination, rows, accumulate=shard in self._held)
        self._held.pop(shard, None)
        self._give(shard, destination)

    def settle(self) -> None:
        """After a backward's reductions: shards carried into it that no rank reduced keep their values."""
        for shard, held in self._held.items():
            if self.keep_full_grads:
                held.div_(self.world_size)
            self._give(shard, held)
        self._held.clear()

    def _give(self, shard: ParamShard, grad_shard: Tensor) -> None:
        self._given[shard] = grad_shard
        shown = self._shown[shard] = self.hand_out(shard, grad_shard) if self.hand_out else grad_shard
        shard.set_grad_shard(shown)

    def buffers(self) -> list[Tensor]:
        """Persistent shard storage (stage 2 and 3), for memory accounting."""
        return list(self._storage.values())


class BucketReductions:
    """The one way gradients are reduced, for stages 1-3: each bucket's reduce-scatter is launched from its gradients
    (packed into a pool buffer, or, ``in_place``, reduced where a large gradient already lies), and once it completes
    the rows are stored in ``GradShards`` and the buffer goes back to the pool. At most ``MAX_IN_FLIGHT`` reductions
    holding memory are pending (``InFlight``). With ``fmt`` (qgZ, ``quantize_grads``) every reduce-scatter is the
    quantized two-stage one (quantized_collectives.py, [Note: the quantized reduce-scatter])."""

    def __init__(self, comms: Collectives, pool: BufferPool, grad_shards: GradShards,
                 fmt: BlockFormat | None = None) -> None:
        self.comms = comms
        self.pool = pool
        self.grad_shards = grad_shards
        #: qgZ: the format gradients are reduced in (``None``: full precision); checked against the group here.
        self.fmt = fmt
        if fmt is not None and not comms.local:
            comms.two_stage([1], fmt)
        self._in_flight = InFlight()

    def launch(self, bucket: Bucket, grads: list[Tensor | None], stored: Sequence[bool], in_place: bool = False,
               guard: Callable[[], None] | None = None) -> None:
        """Reduce ``grads`` (``None`` counts as zeros) and store the rows of the shards marked in ``stored``."""
        buffer = bucket.own_buffer(grads) if in_place else None
        pooled = None
        if buffer is None:
            buffer = pooled = self.pool.take(bucket.full_numel, bucket.dtype)
        reduced = self.comms.reduce_scatter(bucket, grads, buffer=buffer, guard=guard, fmt=self.fmt)
        keep_full = self.grad_shards.keep_full_grads
        if not keep_full:
            for shard in bucket.shards:
                shard.param.grad = None
        # What stays allocated until the reduction completes: the pool buffer, or under stages 2 and 3 the full
        # gradient reduced in place (freed once its rows are stored), and off NCCL the segments it receives.
        holds_buffer = pooled is not None or not keep_full
        held = reduced.held_bytes + (buffer.numel() * buffer.element_size() if holds_buffer else 0)
        # Packed gradients are not kept until completion: only stage 1 stores into its full gradient, and a gradient
        # reduced in place is the buffer itself (stage 3 held two units' full gradients here for nothing).
        kept = grads if keep_full or pooled is None else [None] * len(grads)
        self._in_flight.add(reduced, partial(self._store, bucket, kept, stored, pooled), held)

    def _store(self, bucket: Bucket, grads: list, stored: Sequence[bool], pooled: Tensor | None,
               reduced: list[Tensor]) -> None:
        for shard, full, rows, keep in zip(bucket.shards, grads, reduced, stored):
            if keep:
                self.grad_shards.store(shard, rows, full)
        if pooled is not None:
            self.pool.give(pooled)  # the rows were copied out: the buffer serves the next bucket

    def drain(self) -> None:
        """Complete every reduction launched."""
        self._in_flight.drain()


class GradReducer:
    """Stages 1 and 2: reduce-scatters the gradients of ``shards`` bucket by bucket into ``GradShards``.

    ``keep_full_grads`` is stage 1 (full gradients persist, reduction deferred to the accumulation boundary);
    otherwise stage 2 (only gradient shards persist, reduction on every backward).
    """

    def __init__(self, shards: Sequence[ParamShard], comms: Collectives, config: CommConfig, keep_full_grads: bool,
                 pool: BufferPool | None = None, storage: ShardStorage | None = None, hand_out: HandOut | None = None):
        self.comms = comms
        self.config = config
        self.keep_full_grads = keep_full_grads
        self.grad_shards = GradShards(comms.world_size, keep_full_grads, storage, hand_out)
        self._reductions = BucketReductions(comms, pool or BufferPool(comms.device), self.grad_shards,
                                            grad_format(config))
        self._order = [s for s in reversed(shards) if s.param.is_floating_point()]
        self._plans: dict[tuple[tuple[bool, torch.dtype], ...], list[Bucket]] = {}
        self._plan_key: tuple[tuple[bool, torch.dtype], ...] | None = None
        self._buckets: list[Bucket] = []
        self._position: dict[ParamShard, tuple[int, int]] = {}
        self._ready: list[list[bool]] = []
        self._next_launch = 0
        self._deferring = False
        self._started = False
        self._warned_unused = False
        self._hooks = GradHooks(self._on_grad_ready, self.grad_shards.lend_spare if keep_full_grads else None)
        self._hooks.cover(self._order)
        self._use_plan()

    # ---------------------------------------------------------------------------------------------- before backward

    def pre_backward(self) -> None:
        """Before every backward: the bucket plan of the parameters that now require a gradient, and the gradient
        shards of the last reduction carried in (unless ``zero_grad`` dropped them)."""
        if self._started:
            self.finish()  # a backward that ran outside Lightning's hooks (a bare ``loss.backward()``)
        self._hooks.cover(self._order)
        self._use_plan()
        self.grad_shards.take()

    def _use_plan(self) -> None:
        key = tuple((s.param.requires_grad, s.dtype) for s in self._order)  # a rebinding may change a dtype
        if key != self._plan_key:
            if key not in self._plans:
                trainable = [s for s, (t, _) in zip(self._order, key) if t]
                config = self.config
                self._plans[key] = make_buckets(
                    trainable, config.bucket_bytes, config.reduce_torch_dtype, alone_bytes=config.inplace_bytes
                )
            self._plan_key, self._buckets = key, self._plans[key]
            self._position = {s: (b, i) for b, bucket in enumerate(self._buckets) for i, s in enumerate(bucket.shards)}
        self._ready = [[False] * len(b) for b in self._buckets]
        self._next_launch = 0

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: stage 1 lets full gradients accumulate locally; stage 2 still reduces."""
        self._deferring = self.keep_full_grads
        try:
            yield
        finally:
            self._deferring = False

    # ----------------------------------------------------------------------------------------------- during backward

    def _on_grad_ready(self, shard: ParamShard) -> None:
        if self._deferring or shard not in self._position:
            return
        self._started = True
        b, i = self._position[shard]
        self._ready[b][i] = True
        if self.config.find_unused_parameters:
            return
        while self._next_launch < len(self._buckets) and all(self._ready[self._next_launch]):
            self._launch(self._next_launch)

    def _launch(self, index: int, used: list[bool] | None = None) -> None:
        bucket = self._buckets[index]
        stored = used if used is not None else [True] * len(bucket)
        grads = [s.param.grad if keep else None for s, keep in zip(bucket.shards, stored)]
        self._next_launch = index + 1
        self._reductions.launch(bucket, grads, stored, in_place=True)  # a large gradient is reduced where it is

    # ------------------------------------------------------------------------------------------------ after backward

    def post_backward(self) -> None:
        """After every backward Lightning runs (on every rank): reduce what is left, wait for all of it."""
        if not self._deferring:
            self.finish()

    def finish(self) -> None:
        """Launch every bucket not launched yet (zeros for missing gradients) and wait for all reductions."""
        used = self._agree_on_used() if self.config.find_unused_parameters else None
        if used is None and not self._warned_unused:
            self._warn_unused()
        while self._next_launch < len(self._buckets):
            self._launch(self._next_launch, used[self._next_launch] if used is not None else None)
        self._reductions.drain()
        self.grad_shards.settle()
        self._ready = [[False] * len(b) for b in self._buckets]
        self._next_launch = 0
        self._started = False

    def _agree_on_used(self) -> list[list[bool]]:
        flags = torch.tensor([float(r) for ready in self._ready for r in ready], device=self.comms.device)
        self.comms.world.all_reduce_(flags, "the find_unused_parameters flags")  # any rank of any replica
        used = (flags > 0).tolist()
        out = []
        for ready in self._ready:
            out.append(used[: len(ready)])
            used = used[len(ready) :]
        return out

    def _warn_unused(self) -> None:
        unused = [s.name for bucket, ready in zip(self._buckets, self._ready) for s, r in zip(bucket.shards, ready) if not r]
        if unused and self._started:
            self._warned_unused = True
            warn_unused(unused, self.comms.rank)

    def grad_buffers(self) -> list[Tensor]:
        return self.grad_shards.buffers()

    def remove(self) -> None:
        self._hooks.remove()


def grad_format(config: CommConfig) -> BlockFormat | None:
    """The block format qgZ reduces gradients in (``quantize_grads``), or ``None``."""
    return None if config.quantize_grads is None else BlockFormat(bits=GRAD_QUANTIZATIONS[config.quantize_grads])


def _calling(callback: Callable[[ParamShard], None], shard: ParamShard) -> Callable[[Tensor], None]:
    """A tensor hook that calls ``callback(shard)`` and leaves the gradient as it is."""

    def hook(_tensor: Tensor) -> None:
        callback(shard)

    return hook


def warn_unused(names: list[str], rank: int) -> None:
    """Warned by every rank that finds parameters without a gradient (DDP raises there): one rank may skip a layer
    the others use."""
    warnings.warn(
        f"rank {rank}: {len(names)} parameter(s) got no gradient in a backward (e.g. {names[:3]}); they are reduced as "
        "zeros, so the optimizer still steps them. Pass find_unused_parameters=True to skip parameters that no rank "
        "used, as DDP does.",
        stacklevel=2,
    )
