"""Stage 3: gather each unit's parameters right before it runs, free them right after, reduce its gradients once its
backward is done, prefetch the next unit.

[Note: the life of a unit in one training step]
forward: the pre-hook waits for the unit's all-gather (issued earlier as a prefetch, or now) and issues the next
units', up to ``prefetch`` ahead in the order units ran in the previous step; the post-hook frees the parameters
(``reshard_after_forward``; not those of the unit that ran last in the previous step's forward, which backward reaches
first: it stays gathered, one gather less a step, until a backward or another forward of the step) and hooks the
outputs' gradients. backward: the first output gradient to arrive gathers the unit again (state ``BACKWARD``) and
prefetches the units backward reaches next; once the gradients of the unit's inputs exist (backward is through the
unit) and every trainable parameter of it has its gradient accumulated, the unit is *done*: its gradients are
reduce-scattered (one bucket per dtype) and its parameters freed. Reductions are launched in one fixed order, the
reverse of the unit plan (about backward's order), a done unit waiting for the ones in front of it, so every rank
issues the same collectives in the same order; when backward ends every unit not reduced yet is, with zeros for
missing gradients (or, with ``find_unused_parameters``, after agreeing which parameters any rank used). The root unit
holds the parameters no unit owns (tied weights among them): it is gathered for the whole step and reduced last.
Activation checkpointing re-runs a unit's forward inside backward: its hooks then only make sure the unit is gathered,
in state ``BACKWARD``, so recomputation costs no extra all-gather.

[Note: which gathers qwZ quantizes]
With ``quantize_weights`` every gather of a training or evaluation step is quantized (collectives.py, [Note: the
quantized all-gather]): the pre-forward hook's and its prefetches, the root unit's at the start of a step (which then
serves the backward too, as a unit kept from forward to backward by ``reshard_after_forward=False`` does), and the
backward's (the pre-backward hook's, its prefetches, and so activation checkpointing's recomputation, which runs
inside them). Quantizing is deterministic and the shards do not change between a unit's forward and its backward, so
the backward computes with bitwise the weights its forward computed with, as a unit kept gathered would. With hpZ
the backward's gathers come from the secondary shards the forward kept instead, which hold those same dequantized
values (unit_state.py, [Note: hpZ's secondary shards]) and cross no node. ``gathered`` (state dicts,
``gathered_parameters``, checkpoints) and everything after fit see the exact values: a unit gathered quantized is
gathered again in full precision there. The optimizer updates the fp32 masters from gradients computed through the
quantized weights; the masters themselves never hold quantized values.

[Note: zero3 under torch.compile]
A model compiled whole (``model.compile()``, ``torch.compile(module)``, in ``__init__`` or ``configure_model``) or
block by block runs under zero3 as under DDP. The unit hooks gather, free and reduce, with collectives, Python state
and ``.data`` swaps that a graph cannot hold, so they are ``torch._dynamo.disable``d (as FSDP2's are): a compiled
region that reaches one ends its graph there, the hook runs eagerly, and tracing resumes after it in a new graph.
Graph breaks therefore come at unit boundaries (``ZeroMonitor``'s report counts them by reason, ``UNIT_HOOK_REASON``
for these); a block compiled on its own has its unit's hooks outside its graph (on its ``__call__``) and none. Inside a
unit its parameters are plain ``nn.Parameter``s whose ``.data`` is a view of the gathered storage: it changes from
gather to gather, never its shape, dtype or strides, so the guards dynamo puts on the parameters hold from step to step
and nothing recompiles after the first step. Backward runs each region's compiled backward between the eager hooks
that gather the unit again and reduce its gradients; the parameters a forward graph saved are views of the unit's
storage, refilled by that gather ([Note: how a full parameter is freed and restored] in unit_state.py). Hugging Face's
modules, which lightning_compat.py marks as FSDP-managed for ``generate()``, must also say that their parameters are
the module's own (FSDP's ``use_orig_params``): dynamo then traces them as it traces FSDP's modules, without guards on
their parameters, where it otherwise ended its graph at each of them (a small GPT-2: 25 of its 102 operations captured).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_zero.config import CommConfig, Stage3Config
from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.in_flight import MAX_IN_FLIGHT, BufferPool
from lightning_zero.sharding.buckets import Bucket, make_buckets
from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.grad_hooks import (
    BucketReductions, GradHooks, GradShards, HandOut, ShardStorage, grad_format, warn_unused,
)
from lightning_zero.sharding.quantize import BlockFormat
from lightning_zero.sharding.unit_order import COUNT_RANGE, SharedBoard, unit_order_channel
from lightning_zero.sharding.unit_state import (
    UNBOUNDED,
    RankDivergenceError,
    Unit,
    UnitState,
)


#: Why a compiled region's graph ends at a unit's hook (dynamo names it in the graph break's reason).
UNIT_HOOK_REASON = "a zero3 unit's gather or reshard hook"


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the gradients of those inputs exist, i.e. once backward
    is through the unit and its parameters are no longer needed."""

    @staticmethod
    def forward(ctx, callback, *tensors: Tensor):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads: Tensor):
        ctx.callback()
        return (None, *grads)


def _in_backward() -> bool:
    """Whether autograd is running a backward now (a forward then is an activation-checkpointing recomputation)."""
    return torch._C._current_graph_task_id() != -1


class ShardedParams:
    """Stage 3's addition to stages 1 and 2: units gathered around their forward and backward, reduced per unit
    (see [Note: the life of a unit in one training step])."""

    def __init__(self, root: Unit, units: Sequence[Unit], comms: Collectives, comm: CommConfig, config: Stage3Config,
                 storage: ShardStorage | None = None, hand_out: HandOut | None = None, lean: bool = True, timeout=None):
        self.root = root
        self.lean = lean
        self.units = list(units)
        self._announced = 0
        #: The unit collectives (kind, unit) of this step, of the previous one, and those this step may issue before
        #: the ranks' check completes (see [Note: ranks that run different units]).
        self._sequence: list[tuple[int, int]] = []
        self._previous: list[tuple[int, int]] = []
        self._expected: list[tuple[int, int]] = []
        #: What the unit-order check exchanges through (see [Note: the unit-order board] in unit_order.py).
        self._order: SharedBoard | Collectives | None = None
        if config.verify_unit_order:
            self._order = unit_order_channel(comms, len(self.all_units), timeout)
            for unit in self.all_units:
                unit.announce = self._announce
        self.comms = comms
        self.comm = comm
        self.config = config
        self.grad_shards = GradShards(comms.world_size, keep_full_grads=False, storage=storage, hand_out=hand_out)
        self._reduce_order = self.units[::-1] + [root]
        self._reduce_buckets: dict[tuple[Unit, tuple[bool, ...]], list[Bucket]] = {}
        # Rank-major buffers of unit gathers and reductions, kept across units and steps up to a bound (see [Note:
        # what the buffer pools keep, and where]): one per gather (the unit running and ``prefetch`` ahead) and
        # reduction in flight at once, in at most ``buffer_pool_mb``.
        bound = config.buffer_pool_bytes
        if bound is None:
            bound = 2 * max((self._largest_buffer(u) for u in self.units), default=0)
        self.pool = BufferPool(comms.device, limit=config.prefetch + 1 + MAX_IN_FLIGHT, max_bytes=bound)
        for unit in self.all_units:
            unit.pool = self.pool
            unit.weight_format = BlockFormat(bits=8) if config.quantize_weights else None
        for unit in self.units:  # the root unit stays gathered from forward to backward: no secondary
            unit.hpz = comms.hpz
        self._done: set[Unit] = set()
        self._next_reduce = 0
        self._reductions = BucketReductions(comms, self.pool, self.grad_shards, grad_format(comm))
        self._input_grad_calls: dict[Unit, int] = {}
        self._forward_order: list[Unit] = []
        self._last_order: list[Unit] = []
        self._kept: Unit | None = None  # the unit kept gathered from its forward to its backward
        self._holding = False
        self._warned_unused = False
        self._hooks = []
        for unit in self.units:
            pre, post = _eager(self._pre_forward_hook(unit)), _eager(self._post_forward_hook(unit))
            self._hooks.append(unit.module.register_forward_pre_hook(pre, with_kwargs=True))
            self._hooks.append(unit.module.register_forward_hook(post))
        self._grad_hooks = GradHooks(lambda shard: self._mark(self._unit_of[shard], shard))
        self._unit_of = {shard: unit for unit in self.all_units for shard in unit.shards}
        self._grad_hooks.cover(self._unit_of)

    @property
    def all_units(self) -> list[Unit]:
        return [self.root, *self.units]

    # ---------------------------------------------------------------------------------------------------- forward

    def _pre_forward_hook(self, unit: Unit):
        def hook(_module: nn.Module, args: tuple, kwargs: dict):
            if _in_backward():  # activation checkpointing recomputes the forward: keep it gathered for backward
                unit.enter_backward(self._input_grad_calls.pop(unit, 0))
                return None
            if unit not in self._forward_order:
                self._forward_order.append(unit)
            if not self._holding:
                self._release_kept(unit)
            unit.wait_unshard(quantized=True)
            self._prefetch_after(unit, self._last_order, quantized=True)
            if self._holding or not torch.is_grad_enabled():
                return None
            routed = _route_through_post_backward(lambda: self._mark(unit, "inputs"), args, kwargs)
            if routed is None:
                return None
            self._input_grad_calls[unit] = self._input_grad_calls.get(unit, 0) + 1
            return routed

        return hook

    def _post_forward_hook(self, unit: Unit):
        def hook(_module: nn.Module, _args: tuple, output):
            if _in_backward() or self._holding:
                return
            needing_grad = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
            # Backward starts at the unit the forward ran last (previous step's order): keep it (the first Note).
            kept = (self.config.reshard_after_forward and bool(needing_grad) and bool(self._last_order)
                    and unit is self._last_order[-1])
            if not torch.is_grad_enabled() or (self.config.reshard_after_forward and not kept):
                if torch.is_grad_enabled() and needing_grad:
                    unit.keep_secondary()  # hpZ: what the backward gathers from (nothing to do without it)
                unit.reshard()
            elif kept:
                self._kept = unit
            if torch.is_grad_enabled():
                for tensor in needing_grad:
                    tensor.register_hook(self._pre_backward_hook(unit))
            return

        return hook

    def _release_kept(self, running: Unit) -> None:
        """A second forward before the backward: free the kept unit as the others are, so this one prefetches."""
        kept, self._kept = self._kept, None
        if kept is None or kept is running or kept.state is not UnitState.UNSHARDED:
            return
        kept.keep_secondary()
        kept.reshard()

    def _prefetch_after(self, unit: Unit, order: list[Unit], quantized: bool = False, backward: bool = False) -> None:
        if unit not in order:
            return
        start = order.index(unit) + 1
        for candidate in order[start : start + self.config.prefetch]:
            if sum(u.state is not UnitState.SHARDED for u in self.units) > self.config.prefetch:
                break
            candidate.start_unshard(quantized, backward)

    # --------------------------------------------------------------------------------------------------- backward

    def _pre_backward_hook(self, unit: Unit):
        def hook(_grad: Tensor) -> None:
            if unit.state is UnitState.BACKWARD or unit in self._done:
                return
            unit.enter_backward(self._input_grad_calls.pop(unit, 0))
            self._prefetch_after(unit, self._forward_order[::-1], quantized=True, backward=True)

        return hook

    def _mark(self, unit: Unit, event: object) -> None:
        if unit is self.root or not unit.mark(event):
            return
        unit.reshard()
        self._done.add(unit)
        if not self.comm.find_unused_parameters:
            while self._next_reduce < len(self._reduce_order) and self._reduce_order[self._next_reduce] in self._done:
                self._launch_reduce(self._reduce_order[self._next_reduce])

    def _launch_reduce(self, unit: Unit, used: dict[ParamShard, bool] | None = None) -> None:
        self._next_reduce += 1
        buckets = self._buckets_to_reduce(unit)
        guard = unit.announce("reduce", unit) if buckets else None
        for bucket in buckets:
            grads = [s.param.grad if used is None or used[s] else None for s in bucket.shards]
            if used is None and not self._warned_unused and any(g is None for g in grads):
                self._warned_unused = True
                warn_unused([s.name for s, g in zip(bucket.shards, grads) if g is None], self.comms.rank)
            # With find_unused_parameters: kept where any rank used it, as DDP steps a parameter one rank used.
            stored = [used is None or used[s] for s in bucket.shards]
            self._reductions.launch(bucket, grads, stored, guard=guard)

    def _largest_buffer(self, unit: Unit) -> int:
        """Bytes of the largest rank-major buffer ``unit`` gathers or reduces through."""
        buckets = unit.gather_buckets + self._buckets_to_reduce(unit)
        return max((b.full_numel * b.dtype.itemsize for b in buckets), default=0)

    def _buckets_to_reduce(self, unit: Unit) -> list[Bucket]:
        key = (unit, tuple(s.trainable for s in unit.shards))
        if key not in self._reduce_buckets:
            trainable = [s for s in unit.shards if s.trainable and s.param.is_floating_point()]
            self._reduce_buckets[key] = make_buckets(trainable, UNBOUNDED, self.comm.reduce_torch_dtype)
        return self._reduce_buckets[key]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: stage 3 reduces every micro-batch into the gradient shards (nothing to defer)."""
        yield

    def pre_backward(self) -> None:
        """Before every backward: carry the gradient shards of the last reduction into it (see ``GradShards``)."""
        self._grad_hooks.cover(self._unit_of)
        self.grad_shards.take()
        self._done.clear()
        self._next_reduce = 0

    def post_backward(self) -> None:
        """After every backward (on every rank): reduce every unit not reduced yet, in the fixed order, and free
        every unit but the root (the step may still run forwards through it)."""
        used = self._agree_on_used() if self.comm.find_unused_parameters else None
        while self._next_reduce < len(self._reduce_order):
            self._launch_reduce(self._reduce_order[self._next_reduce], used)
        self._reductions.drain()
        self.grad_shards.settle()
        for unit in self.units:
            unit.reshard()
            unit.drop_secondary()  # hpZ: backward is over; a unit it never reached kept one for nothing
        self._done.clear()
        self._next_reduce = 0

    def _agree_on_used(self) -> dict[ParamShard, bool]:
        shards = [s for unit in self._reduce_order[self._next_reduce :] for b in self._buckets_to_reduce(unit) for s in b.shards]
        flags = torch.tensor([float(s.param.grad is not None) for s in shards], device=self.comms.device)
        self.comms.world.all_reduce_(flags, "the find_unused_parameters flags")  # any rank of any replica
        return dict(zip(shards, (flags > 0).tolist()))

    _KINDS = ("gather", "reduce")

    def _announce(self, kind: str, unit: Unit) -> Callable[[], None] | None:
        """[Note: ranks that run different units] Every unit collective is a collective: if one rank gathers a unit
        that another skipped (a branch taken on some ranks only), their collectives no longer pair up; gloo aborts the
        process on the size mismatch, NCCL hangs until the process-group timeout. So for each one, the ranks swap
        which unit they are about to move (three integers, no device synchronisation: through memory where the
        group's ranks share a host, else over a CPU control group of its own; see [Note: the unit-order board] in
        unit_order.py), and a disagreement raises on every rank, naming both units, before any of them waits on a
        mismatched collective.

        Waiting for that swap before every collective holds the ranks in lockstep some 25 times a step (measured on 2
        CPU ranks: 507-536 ms a step against 438-482 ms without the check). So a rank waits for it only when it is
        about to issue something other than ``_expected``, the sequence of unit collectives of the last two steps where
        they were the same (the first steps, a branch taken, the first evaluation steps); otherwise it issues the
        collective at once and checks the swap before waiting on it (the collective's ``guard``). The steps before were
        checked, so every rank starts a step expecting the same sequence: where two ranks are about to issue different
        collectives, at least one of them leaves the expected sequence, checks before issuing and raises, and the
        mismatched pair is never issued. The collective the other rank did issue has no counterpart, so under NCCL a
        rank aborts the group before raising (``Collectives.abort``): that collective ends at once instead of at the
        process-group timeout. A rank that issued only part of the expected sequence (it ended its step early) expects
        nothing in the next step, so its next collective is checked first too."""
        self._announced += 1
        mine = [self._KINDS.index(kind), unit.index, self._announced % COUNT_RANGE]  # as the board holds it
        position = len(self._sequence)
        self._sequence.append((mine[0], mine[1]))
        if position < len(self._expected) and self._expected[position] == self._sequence[-1]:
            exchanged = self._order.exchange_async(mine)
            return lambda: self._check_same_unit(kind, unit, mine, exchanged.wait())
        self._check_same_unit(kind, unit, mine, self._order.exchange(mine))
        return None

    def _check_same_unit(self, kind: str, unit: Unit, mine: list[int], everyone: list[list[int]]) -> None:
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                units = {u.index: u for u in self.all_units}
                error = RankDivergenceError(
                    f"ranks diverged under zero3: this rank (rank {self.comms.rank}) is about to {kind} "
                    f"{unit} (unit collective #{mine[2]} of this step), rank {rank} to "
                    f"{self._KINDS[theirs[0]]} {units[theirs[1]]} (#{theirs[2]}). Every rank must run the same units "
                    "in the same order: run the branch on every rank, or make the modules it skips part of the root "
                    "unit (units=...). Hugging Face's generate() stops a rank whose sequences ended early unless it "
                    "is given synced_gpus=True (ZeroStrategy sets it for transformers' models under zero3: pass it "
                    "where generate() is called on another module)"
                )
                self.comms.abort()  # a collective issued before this check has no counterpart on the other ranks
                raise error

    # ------------------------------------------------------------------------------------------------------ steps

    def begin_step(self) -> None:
        """Before a training or evaluation step: the root unit's parameters are needed throughout."""
        self._announced = 0
        if self._sequence:
            finished, self._sequence = self._sequence, []
            self._expected = finished if finished == self._previous else []
            self._previous = finished
        self.root.wait_unshard(quantized=True)

    def after_update(self, stepped: Sequence[ParamShard], defer: bool = False) -> None:
        """Units are gathered from the updated shards when they next run; one still gathered (the root unit during
        a step, manual optimization's later forwards, ``gathered_parameters``) is gathered again now."""
        stepped = set(stepped)
        for unit in self.all_units:
            if any(s in stepped for s in unit.shards):
                unit.drop_secondary()  # hpZ: it holds the values before the update
            if unit.state is not UnitState.SHARDED and any(s in stepped for s in unit.shards):
                unit.refresh()

    def wait(self) -> None:
        """Nothing is deferred past a step: each unit is gathered when it next runs."""

    def reading_guard(self):
        return nullcontext()

    def end_step(self) -> None:
        """After the step's last backward, or an evaluation step: free every unit, the root included; under qwZ,
        raise if a gather of the step held an inf or a NaN (quantized_collectives.py, [Note: the quantized
        all-gather])."""
        if self._forward_order:
            self._last_order, self._forward_order = self._forward_order, []
        self._input_grad_calls.clear()
        self._kept = None
        for unit in self.units:
            unit.drop_secondary()
        if not self._holding:
            for unit in self.all_units:
                unit.reshard()
        if self.config.buffer_pool_mb is None and self.lean:  # see [Note: what the buffer pools keep, and where]
            self.pool.clear()
        self.comms.weight_check.raise_if_nonfinite()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit gathered, and kept so through forwards run meanwhile; on exit each unit is as it was (a unit
        gathered for the step in progress, the root between forward and backward, is gathered again, as before)."""
        if self._holding:
            yield
            return
        before = {unit: unit.quantized for unit in self.all_units if unit.state is not UnitState.SHARDED}
        for unit in self.all_units:
            unit.drop_secondary()  # hpZ: edits made while gathered would make it stale
            if unit.quantized:  # gathered for a forward under qwZ: the exact values are wanted here
                unit.reshard()
            unit.wait_unshard()
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            for unit in self.all_units:
                unit.reshard(compare=True)  # user code had the values: writes through .data are taken too
                if unit in before:
                    unit.wait_unshard(quantized=before[unit])

    def grad_buffers(self) -> list[Tensor]:
        return self.grad_shards.buffers()

    def secondary_shards(self) -> list[Tensor]:
        """hpZ's secondary shards held now (see [Note: hpZ's secondary shards] in unit_state.py)."""
        return [t for unit in self.units for t in unit.secondary_shards()]

    def kept_buffers(self) -> list[Tensor]:
        """The free gather and reduction buffers the pool keeps (see [Note: what the buffer pools keep, and where])."""
        return self.pool.buffers()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._grad_hooks.remove()
        if isinstance(self._order, SharedBoard):
            self._order.close()
        self._order = None


def _eager(hook: Callable) -> Callable:
    """A unit hook that a compiled region calls but does not trace (see [Note: zero3 under torch.compile])."""
    return torch._dynamo.disable(hook, recursive=True, reason=UNIT_HOOK_REASON)


def _route_through_post_backward(callback, args: tuple, kwargs: dict):
    """Route the tensor inputs that need a gradient through :class:`_PostBackward`; ``None`` if there are none."""
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]
    if not positions:
        return None
    routed = _PostBackward.apply(callback, *(flat[i] for i in positions))
    for i, tensor in zip(positions, routed):
        flat[i] = tensor
    return tree_unflatten(flat, spec)
