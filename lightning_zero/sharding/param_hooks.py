"""Stage 3: gather each unit's parameters right before it runs, free them right after, prefetch the next unit.

[Note: how a full parameter is freed and restored]
The module keeps its own ``nn.Parameter`` objects, so that user code, tied weights, the optimizer's bookkeeping and
autograd all refer to one object per parameter. While sharded, its ``.data`` is an empty tensor (code that touches
it outside a forward sees 0 elements, never freed memory); to unshard, the unit's shards are all-gathered, copied into
one flat tensor per unit and each parameter's ``.data`` becomes its view of it. Swapping ``.data`` leaves the version
counter alone, so autograd accepts the parameters it saved in forward once the pre-backward hook has gathered them
again.

[Note: the life of a unit in one training step]
forward: pre-hook waits for the unit's all-gather (issued earlier as a prefetch, or now) and issues the next units'
gathers, up to ``prefetch`` ahead in the order units ran in the previous step; post-hook frees the parameters
(``reshard_after_forward``) and hooks the outputs' gradients. backward: the first output gradient to arrive
gathers the unit again and prefetches the units backward will reach next (reverse forward order); once every
gradients of the unit's inputs exist (backward is through the unit) and every trainable parameter of it has its
gradient accumulated, the parameters are freed; the gradients go to the reducer in grad_hooks.py. A unit whose
inputs need no gradient (the first one, or one behind frozen ones) is freed when backward ends. Every rank must run the same units in the same order: unit gathers are collectives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import Enum, auto

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_zero.sharding.collectives import Collectives, Handle
from lightning_zero.sharding.flat_param import FlatLayout, ParamShard


class UnitState(Enum):
    SHARDED = auto()
    """Only the local shards exist; the full parameters have 0-byte storage."""
    GATHERING = auto()
    """An all-gather of the shards is in flight (a prefetch); the full parameters are not usable yet."""
    UNSHARDED = auto()
    """The full parameters hold the current values."""


class Unit:
    """The parameters of one module that are gathered and freed together."""

    def __init__(self, name: str, module: nn.Module, shards: Sequence[ParamShard], comms: Collectives) -> None:
        self.name = name
        self.module = module
        self.shards = list(shards)
        self.comms = comms
        self.layout = FlatLayout([s.spec for s in shards]) if shards else None
        self.state = UnitState.SHARDED
        self._pending: tuple[Tensor, Handle] | None = None
        self._trainable = sum(1 for s in shards if s.trainable)
        self._grads_pending = self._trainable
        self._backward_done = False

    def start_unshard(self) -> None:
        """Issue the all-gather of this unit's shards, unless it is already gathered or on its way."""
        if self.state is not UnitState.SHARDED:
            return
        if self.layout is None:
            self.state = UnitState.UNSHARDED
            return
        first = self.shards[0].full
        buffer = torch.empty(self.layout.full_numel, dtype=first.dtype, device=first.device)
        own_segment = buffer.view(self.comms.world_size, -1)[self.comms.rank]
        with torch.no_grad():
            self.layout.pack_local([s.local for s in self.shards], own_segment)
        self._pending = (buffer, self.comms.all_gather_(buffer))
        self.state = UnitState.GATHERING

    def wait_unshard(self) -> None:
        """Make the full parameters usable, gathering now if no prefetch did."""
        self.start_unshard()
        if self.state is UnitState.UNSHARDED:
            return
        assert self._pending is not None and self.layout is not None
        buffer, handle = self._pending
        self._pending = None
        handle.wait()
        first = self.shards[0].full
        unsharded = torch.empty(self.layout.unpadded_numel, dtype=first.dtype, device=first.device)
        views = unsharded.split([s.spec.numel for s in self.shards])
        with torch.no_grad():
            self.layout.unpack(buffer, views)
        for shard, view in zip(self.shards, views):
            shard.full.data = view.view(shard.spec.shape)
        self.state = UnitState.UNSHARDED
        self._grads_pending = self._trainable
        self._backward_done = False

    def reshard(self) -> None:
        """Free the full parameters (a gather in flight is completed first, to keep ranks' collectives aligned)."""
        if self.state is UnitState.GATHERING:
            self.wait_unshard()
        if self.state is UnitState.UNSHARDED:
            for shard in self.shards:
                shard.full.data = _empty_like(shard.full)
        self.state = UnitState.SHARDED

    def on_grad_accumulated(self) -> None:
        self._grads_pending -= 1
        self._reshard_if_backward_done()

    def on_backward_through(self) -> None:
        self._backward_done = True
        self._reshard_if_backward_done()

    def _reshard_if_backward_done(self) -> None:
        # Both conditions (see [Note: the life of a unit in one training step]): autograd may still need the
        # parameters for an input gradient, and AccumulateGrad needs them at full shape.
        if self._backward_done and self._grads_pending <= 0:
            self.reshard()

    def detach(self) -> None:
        """Stop managing the parameters (end of fit: they hold their full values for good)."""
        self.shards, self.layout, self._pending = [], None, None
        self.state = UnitState.UNSHARDED


def free_full_parameter(param: nn.Parameter) -> None:
    """The sharded state of a full parameter: an empty tensor of its dtype and device."""
    param.data = _empty_like(param)


def _empty_like(tensor: Tensor) -> Tensor:
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device)


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


class ParamGatherer:
    """Runs the units of one module through [Note: the life of a unit in one training step]."""

    def __init__(self, root: Unit, units: Sequence[Unit], prefetch: int, reshard_after_forward: bool) -> None:
        self.root = root
        self.units = list(units)
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self._forward_order: list[Unit] = []
        self._last_order: list[Unit] = []
        self._hooks = []
        for unit in self.units:
            pre = unit.module.register_forward_pre_hook(self._make_pre_forward(unit), with_kwargs=True)
            post = unit.module.register_forward_hook(self._make_post_forward(unit))
            self._hooks += [pre, post]
            for shard in unit.shards:
                if shard.trainable:
                    self._hooks.append(shard.full.register_post_accumulate_grad_hook(_grad_hook(unit)))

    def _make_pre_forward(self, unit: Unit):
        def hook(_module: nn.Module, args: tuple, kwargs: dict):
            if unit not in self._forward_order:
                self._forward_order.append(unit)
            unit.wait_unshard()
            self._prefetch_after(unit, self._last_order)
            if not torch.is_grad_enabled():
                return None
            return _register_post_backward(unit.on_backward_through, args, kwargs)

        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(_module: nn.Module, _args: tuple, output):
            if not torch.is_grad_enabled():
                unit.reshard()
                return None
            if self.reshard_after_forward:
                unit.reshard()
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._make_pre_backward(unit))
            return None

        return hook

    def _make_pre_backward(self, unit: Unit):
        def hook(_grad: Tensor) -> None:
            if unit.state is UnitState.UNSHARDED:
                return
            unit.wait_unshard()
            self._prefetch_after(unit, self._forward_order[::-1])

        return hook

    def _prefetch_after(self, unit: Unit, order: list[Unit]) -> None:
        if unit not in order:
            return
        start = order.index(unit) + 1
        for candidate in order[start : start + self.prefetch]:
            if self._live_units() > self.prefetch:
                break
            candidate.start_unshard()

    def _live_units(self) -> int:
        return sum(1 for u in self.units if u.state is not UnitState.SHARDED)

    def begin_step(self) -> None:
        """Before a training, validation, test or predict step: the root unit's parameters are needed throughout."""
        self.root.wait_unshard()

    def end_step(self) -> None:
        """After backward, or after a step without one: free every unit still gathered (frozen units whose inputs
        need no gradient, units with unused outputs, the root)."""
        if self._forward_order:
            self._last_order, self._forward_order = self._forward_order, []
        for unit in self.units + [self.root]:
            unit.reshard()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """All full parameters present for user code (generation, export); freed again on exit."""
        for unit in [self.root] + self.units:
            unit.wait_unshard()
        try:
            yield
        finally:
            for unit in self.units + [self.root]:
                unit.reshard()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _grad_hook(unit: Unit):
    def hook(_param: Tensor) -> None:
        unit.on_grad_accumulated()

    return hook


def _register_post_backward(callback, args: tuple, kwargs: dict):
    """Route the tensor inputs that need a gradient through :class:`_PostBackward`; ``None`` if there are none."""
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]
    if not positions:
        return None
    routed = _PostBackward.apply(callback, *(flat[i] for i in positions))
    for i, tensor in zip(positions, routed):
        flat[i] = tensor
    return tree_unflatten(flat, spec)
