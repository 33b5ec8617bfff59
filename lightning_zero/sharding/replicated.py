"""Stages 1 and 2: every rank keeps the full parameters; after an update each rank's new shards are all-gathered
into them, bucket by bucket, overlapped with the next forward (stage 3 replaces this with the units of
param_hooks.py).

[Note: the parameter all-gather overlaps the next forward]
After an update (automatic optimization) the gathers are *launched*, not waited: buckets go out in parameter order
(about the order the forward uses them) until ``MAX_IN_FLIGHT`` of them hold a pool buffer (a large parameter
gathered into its own storage holds none and does not count: see [Note: a large parameter is its own buffer]), and
the step returns. Each module that owns a stepped parameter has a forward pre-hook that completes, in launch order,
every bucket up to the last one holding its own parameters: wait, unpack into the parameters (one fused copy; none
for a parameter gathered in place), give the buffer back to the pool and launch the next buckets. So the next
forward computes with the first layers while the last ones are still on the wire, and no more than
``MAX_IN_FLIGHT`` bucket buffers ever exist. In a lean run, once the last bucket is complete the pool hands its
buffers back to the allocator (and so does a step that starts with nothing in flight): the forward's activations,
which peak at the start of the backward, reuse that memory, and the backward's last reductions, when most
activations are freed, allocate it again. DDP's buckets are the gradients themselves, and a training peak above DDP's
by one packed bucket is what this avoids.

[Note: what the gathers in flight hold]
Left in flight, the gathers hold up to ``MAX_IN_FLIGHT`` bucket buffers from the step to the next forward (with the
reductions' buffers the pool kept for them). Against a model of a few hundred MiB two buckets of ``bucket_mb`` are
nothing; against a small one a bucket holds every packed parameter, a second copy of the working parameters: zero1 in
bf16-mixed on a 3.7M-parameter GPT-2 held 1.20x its 4Ψ + 12Ψ/N after a step, and on the 10.6M GPT of BENCHMARKS.md's
M-2 in fp32 1.4x its 8Ψ + 8Ψ/N. Smaller buckets bound that, but keep the read guard on through most of the forward:
eight buckets of 1 MiB made that GPT-2's zero1 step 1.4x the CPU time. So by default (``overlap_gather=None``) a run
whose model states are a small share of its memory budget keeps the overlap, and the pool's buffers between steps;
a lean one ([Note: lean or fast memory] in memory_policy.py) leaves the gathers in flight only where their buffers
hold at most ``OVERLAP_SHARE`` of the parameters, under 6.3% of any stage's model states (every stage holds at least
its full parameters); elsewhere they complete before the step returns, and the pool's buffers go with them.
``overlap_gather=True`` keeps the overlap whatever the budget, ``False`` never.

Correctness first: a parameter must never be read while its bucket is in flight (its rows are the previous step's).
Reads that do not go through its module's forward are caught three ways. Inside ``training_step`` a
``TorchFunctionMode`` (``reading_guard``) sees every tensor operation and completes the bucket of any pending
parameter an operation touches (``self.wpe.weight[:T]``, a tied weight used with ``F.linear``, a parameter of the
LightningModule itself); everything else that reads parameters (evaluation, checkpoints, ``gathered_parameters``,
teardown, ``load_state_dict``, the next step itself) calls ``wait``; and user hooks that run between the step and the
next ``training_step`` (``on_train_batch_end`` ...) are preceded by ``wait`` unless every callback there declares it
reads no parameters (see ``lightning_zero.sharding.overlap``). A model compiled with ``torch.compile`` (given to the
Trainer compiled, or with compiled submodules) completes every bucket before ``training_step`` instead, as dynamo
does not trace through the guard; a function compiled inside ``training_step`` is not detected, and dynamo then
fails on the guard (a clear error, never a wrong value). Manual optimization, and a LightningModule that
overrides ``optimizer_step``, gather at once: user code continues right after ``optimizer.step()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_zero.config import CommConfig
from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.in_flight import MAX_IN_FLIGHT, BucketGather, BufferPool, gather_bucket
from lightning_zero.sharding.buckets import Bucket, make_buckets
from lightning_zero.sharding.flat_param import ParamShard


#: The share of the gathered parameters' bytes the gathers after an update may hold to be left in flight by default.
OVERLAP_SHARE = 1 / 16


class ReplicatedParams:
    """Full parameters on every rank, rebuilt from the shards after each update (see [Note: the parameter
    all-gather overlaps the next forward])."""

    def __init__(self, module: nn.Module, shards: Sequence[ParamShard], comms: Collectives, config: CommConfig,
                 pool: BufferPool, lean: bool = True) -> None:
        self.comms = comms
        self.lean = lean
        self.config = config
        self.pool = pool
        self._buckets: dict[tuple[tuple[ParamShard, torch.dtype], ...], list[Bucket]] = {}
        #: Buckets launched or queued, in launch order, and the index of the first one not completed.
        self._order: list[Bucket] = []
        #: Per launched bucket, its gather (None once completed).
        self._launched: list[BucketGather | None] = []
        self._done = 0
        #: Parameter (by id) whose bucket is in flight -> index of its bucket in ``_order``.
        self._pending: dict[int, int] = {}
        by_param = {s.param: s for s in shards}
        self._owned: dict[nn.Module, list[ParamShard]] = {}
        for owner in module.modules():
            if owner is module:
                continue  # the LightningModule's own parameters are waited for when read (its forward runs first)
            own = [by_param[p] for p in owner.parameters(recurse=False) if p in by_param]
            if own:
                self._owned[owner] = own
        self._hooks = [m.register_forward_pre_hook(self._pre_forward(m)) for m in self._owned]
        self._completing = False
        self._compiled = _compiled(module)

    @torch.no_grad()
    def gather(self, shards: Sequence[ParamShard], defer: bool = False) -> None:
        """All-gather the local shards (cast to the parameters' dtype) of ``shards`` into their full parameters;
        ``defer`` returns once the first buckets are launched (the rest completes on use)."""
        self.wait()
        key = tuple((s, s.dtype) for s in shards)  # a rebinding may change a parameter's dtype
        if key not in self._buckets:
            # In parameter order, as the next forward uses them: a packed bucket (kept open across the large
            # parameters) goes where its first parameter is, not after the large ones it spans.
            position = {shard: i for i, shard in enumerate(shards)}
            buckets = make_buckets(shards, self.config.bucket_bytes, alone_bytes=self.config.inplace_bytes)
            self._buckets[key] = sorted(buckets, key=lambda bucket: position[bucket.shards[0]])
        self._order = list(self._buckets[key])
        self._launched, self._done = [], 0
        self._pending = {id(s.param): i for i, b in enumerate(self._order) for s in b.shards}
        self._launch_more()
        if not defer or not self._overlaps(self._order):
            self.wait()

    def _overlaps(self, buckets: list[Bucket]) -> bool:
        """Whether the gathers of ``buckets`` stay in flight after the step (see [Note: what the gathers in flight
        hold])."""
        if self.config.overlap_gather is not None:
            return self.config.overlap_gather
        if not self.lean:  # see [Note: lean or fast memory] in memory_policy.py
            return True
        pooled = sorted((b.full_numel * b.dtype.itemsize for b in buckets
                         if b.own_buffer([s.param for s in b.shards]) is None), reverse=True)
        params = sum(s.spec.numel * s.dtype.itemsize for b in buckets for s in b.shards)
        return sum(pooled[:MAX_IN_FLIGHT]) <= OVERLAP_SHARE * params

    def after_update(self, stepped: Sequence[ParamShard], defer: bool = False) -> None:
        """The shards an optimizer just stepped are gathered into their parameters, for the next forward."""
        self.gather(stepped, defer)

    def _launch_more(self) -> None:
        """Launch the next buckets in order while fewer than ``MAX_IN_FLIGHT`` pending ones hold a pool buffer (a
        parameter gathered in place holds none)."""
        while len(self._launched) < len(self._order):
            bucket = self._order[len(self._launched)]
            own = bucket.own_buffer([s.param for s in bucket.shards])  # a large parameter is gathered in place
            if own is None and sum(g.pooled is not None for g in self._launched[self._done :]) >= MAX_IN_FLIGHT:
                return
            self._launched.append(gather_bucket(self.comms, self.pool, bucket, into=own))

    def _complete_through(self, index: int) -> None:
        """Complete every bucket up to ``index`` in launch order, launching the next one as each frees its buffer."""
        self._completing = True  # the unpack's own operations touch pending parameters: not a read to guard
        try:
            while self._done <= index:
                bucket = self._order[self._done]
                params = [s.param for s in bucket.shards]
                self._launched[self._done].complete(partial(bucket.unpack, tensors=params))
                for shard in bucket.shards:
                    shard.mark_written()
                    self._pending.pop(id(shard.param), None)
                self._launched[self._done] = None
                self._done += 1
                self._launch_more()
            if self._done == len(self._order) and self.lean:
                self.pool.clear()
        finally:
            self._completing = False

    @torch.no_grad()
    def wait(self) -> None:
        """Every parameter holds its current values when this returns."""
        if self._done < len(self._order):
            self._complete_through(len(self._order) - 1)

    @property
    def in_flight(self) -> bool:
        return self._done < len(self._order)

    def _pre_forward(self, module: nn.Module):
        own = self._owned[module]

        @torch.no_grad()
        def hook(_module: nn.Module, _args: tuple) -> None:
            if self._pending:
                needed = [self._pending[id(s.param)] for s in own if id(s.param) in self._pending]
                if needed:
                    self._complete_through(max(needed))

        return hook

    def reading_guard(self):
        """Around ``training_step``: operations touching a parameter whose bucket is in flight complete it first.
        A compiled model completes every bucket first instead: dynamo cannot trace through the guard's mode."""
        if self._pending and self._compiled:
            self.wait()
        return _ReadGuard(self) if self._pending else nullcontext()

    def _touch(self, values) -> None:
        if self._completing:
            return
        for value in values:
            if isinstance(value, (list, tuple)):
                self._touch(value)
            elif isinstance(value, Tensor) and id(value) in self._pending:
                with torch.no_grad():
                    self._complete_through(self._pending[id(value)])

    def begin_step(self) -> None:
        """Nothing to gather (the parameters are full, or complete on use); with nothing in flight (gradient
        accumulation, an evaluation step) the buffers the last reductions left in the pool are freed."""
        if not self.in_flight and self.lean:
            self.pool.clear()

    def end_step(self) -> None:
        """Nothing to free."""

    @contextmanager
    def gathered(self) -> Iterator[None]:
        self.wait()
        yield

    def kept_buffers(self) -> list[Tensor]:
        """The free bucket buffers the pool keeps (shared with the gradient reductions)."""
        return self.pool.buffers()

    def remove(self) -> None:
        """Drop the hooks; gathers still in flight are left alone (after an error a peer may never answer)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _compiled(module: nn.Module) -> bool:
    """Whether ``module`` was given to the Trainer compiled (Lightning keeps the compile settings on it) or holds
    compiled submodules (a model compiled inside a function is not seen: see [Note: the parameter all-gather
    overlaps the next forward])."""
    if getattr(module, "_compiler_ctx", None) is not None:
        return True
    return any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in module.modules())


class _ReadGuard(TorchFunctionMode):
    """Completes a pending parameter's bucket before any operation reads it (see the module docstring)."""

    def __init__(self, params: ReplicatedParams) -> None:
        super().__init__()
        self.params = params

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.params._pending:
            self.params._touch(args)
            self.params._touch(kwargs.values())
        return func(*args, **kwargs)
