"""What a sharded parameter's ``.grad`` is in user code: ``ShardedGrad``, this rank's rows of the averaged gradient,
with the gradient's full shape, answering every question as the full gradient would, or refusing it by name.

[Note: a sharded gradient answers as the full one]
Under stages 1-3 a rank holds only its rows of each averaged gradient (see [Note: the reduced gradient lives in
param.grad] in flat_param.py). Code written for DDP reads and edits ``p.grad`` in hooks: ``clip_grad_norm_`` and
Lightning's ``grad_norm`` in ``on_before_optimizer_step``, rows zeroed in ``on_after_backward`` (frozen vocabulary),
``clip_grad_value_``, checks like ``torch.isfinite(p.grad).all()``. Given the bare shard, each of those gives a
silently different answer (a shard's norm, indices off by the rank's first row). So user code gets a
``ShardedGrad``: a tensor subclass of the full shape and dtype holding the shard, whose ``__torch_dispatch__``
answers each operation from the shards of every rank:

* element-wise operations (``mul_``, ``clamp_``, ``zero_``, ``masked_fill_``, ``copy_`` from a full tensor,
  arithmetic with scalars and with full-shape tensors) run on the rank's rows: every rank runs the same code, so
  together they compute what DDP computes on the full gradient, and in-place ones change the shard the optimizer
  steps;
* slicing and indexing on any dimension keep the full tensor's indices (``p.grad[:1000] = 0`` zeroes rows 0-999
  wherever they live), and so do reshapes that keep rows whole (``view(-1)``);
* reductions over every element, or over the first dimension (``norm``, ``sum``, ``mean``, ``max``, ``all``,
  ``any``, ``equal``, ``item()``), combine the ranks' partial results with one all-reduce that every rank must run
  (a read run on one rank fails there within seconds: [Note: a read that runs on one rank] in joined_reads.py), except the
  2-norm and the largest magnitude of each whole gradient (``p.grad.norm()``, ``p.grad.abs().max()``): taken for
  every gradient together when the gradients become complete and kept until a gradient changes (a scalar factor,
  ``clip_grad_norm_``'s, scales them), so ``clip_grad_norm_`` and ``grad_norm`` need no collective, on any rank;
* random fills (``randn_like``, ``normal_``) draw the full tensor, as DDP's would, and keep the rank's rows;
* anything that would need the other ranks' rows as values (``p.grad[mask]`` read out, ``.numpy()``, ``tolist()``,
  a transpose across the first dimension, copying the gradient into a plain tensor) raises ``ShardedGradientError``
  naming the operation, the parameter and the way out: ``with trainer.strategy.gathered_gradients():`` gives plain
  full gradients inside (every rank must enter it; edits made inside are kept).

A ``ShardedGrad`` has no storage of its own; its ``RowLayout`` says which rows of the full tensor the rank holds
(a 0-d tensor, or a row picked out of the first dimension, counts as one row held by one rank). The optimizer step
takes the shard back (``grad_rows``), so an edit in a hook is what the step uses.

The machinery is ``ShardedRows``'; ``ShardedGrad`` only says that its rows are a gradient's. The values of a stage-3
parameter between its uses answer the same way (``sharded_param.ShardedValues``, [Note: a parameter's values between
its uses]).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten


class ShardedGradientError(RuntimeError):
    """An operation on a sharded gradient would need the other ranks' rows as values."""


class Reducer(Protocol):
    """What a ``ShardedRows`` needs from its owner (``user_view.UserView``, or its ``ValuesOwner``)."""

    def all_reduce(self, tensor: Tensor, op: str) -> Tensor:
        """``tensor`` reduced across the ranks holding the other rows with ``op`` ("sum", "max" or "min")."""


    def changed(self, key: int | None = None, factor: Any = None) -> None:
        """Its rows were written in place: the whole gradient ``key`` multiplied by ``factor`` (a number or a 0-d
        tensor), or anything (``None``)."""

    def whole_norms(self, ord: float) -> dict[int, Tensor]:
        """The ``ord``-norm of every whole gradient handed out, by its key."""


@dataclass(frozen=True)
class RowLayout:
    """Which rows of a tensor of ``shape`` this rank holds: ``[lo, hi)`` of its first dimension, or, with
    ``single``, the whole tensor as one row (``hi - lo`` is 1 where it is held, 0 elsewhere). The local tensor has
    ``hi - lo`` rows: shape ``(hi - lo, *shape[1:])``, or ``(hi - lo, *shape)`` with ``single``."""

    shape: torch.Size
    lo: int
    hi: int
    single: bool = False

    @property
    def rows(self) -> int:
        return 1 if self.single else self.shape[0]

    @property
    def local_shape(self) -> torch.Size:
        rest = self.shape if self.single else self.shape[1:]
        return torch.Size((self.hi - self.lo, *rest))

    @property
    def row_numel(self) -> int:
        return math.prod(self.local_shape[1:])

    def narrowed(self, start: int, end: int) -> RowLayout:
        """Rows ``[start, end)`` of the first dimension."""
        lo, hi = min(max(self.lo, start), end), min(max(self.hi, start), end)
        return RowLayout(torch.Size((end - start, *self.shape[1:])), lo - start, hi - start)

    def picked(self, index: int) -> RowLayout:
        """Row ``index`` of the first dimension, as a tensor of its own."""
        held = self.lo <= index < self.hi
        return RowLayout(self.shape[1:], 0, int(held), single=True)


class ShardedRows(torch.Tensor):
    """This rank's rows (``local``) of a tensor of ``layout.shape`` that answers as the full tensor would (see [Note:
    a sharded gradient answers as the full one]); ``ShardedGrad`` is a gradient's, ``sharded_param.ShardedValues`` a
    stage-3 parameter's values. ``key`` names the parameter whose whole gradient this is (``None`` for tensors
    derived from one, and for values). A subclass says what it is in ``__repr__`` and ``refusal``."""

    _local: Tensor
    _layout: RowLayout
    _owner: Reducer
    _key: int | None
    #: The key of the whole gradient this is the absolute value of (``p.grad.abs()``), else ``None``.
    _abs_of: int | None
    _name: str

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local: Tensor, layout: RowLayout, owner: Reducer, name: str, key: int | None = None):
        if local.shape != layout.local_shape:
            raise AssertionError(f"{name}: local rows of shape {tuple(local.shape)}, layout {layout}")
        rows = torch.Tensor._make_wrapper_subclass(cls, layout.shape, dtype=local.dtype, device=local.device,
                                                   requires_grad=False)
        rows._local, rows._layout, rows._owner, rows._name, rows._key = local, layout, owner, name, key
        rows._abs_of = None
        return rows

    def refusal(self, what: str) -> Exception:
        """The error for ``what``, an operation that would need the other ranks' rows as values."""
        raise NotImplementedError

    def _where(self) -> str:
        layout = self._layout
        return (f"rows {layout.lo}-{layout.hi} of {layout.rows}" if not layout.single else
                ("held here" if layout.hi else "held by another rank"))

    def __str__(self) -> str:
        return repr(self)

    def __format__(self, spec: str) -> str:
        return repr(self)

    def untyped_storage(self):  # the memory behind it: this rank's rows
        return self._local.untyped_storage()

    def data_ptr(self) -> int:
        return self._local.data_ptr()

    def tolist(self):
        refuse("tolist()", self)

    def numpy(self, *, force: bool = False):
        refuse("numpy()", self)

    def __array__(self, *args, **kwargs):
        refuse("converting it to a NumPy array", self)

    def __deepcopy__(self, memo):  # a module copied with them (copy.deepcopy) keeps them sharded
        copied = type(self)(self._local.clone(), self._layout, self._owner, self._name)
        if getattr(self, "_is_param", False):  # a parameter of a copy of a sharded model (nn.Parameter's flag)
            copied = torch.nn.Parameter(copied, self.requires_grad)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol):
        refuse("pickling (torch.save)", self)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = HANDLERS.get(func.overloadpacket)
        if handler is not None:
            return handler(func, args, kwargs)
        if func.overloadpacket in ELEMENT_WISE or torch.Tag.pointwise in func.tags:
            return element_wise(func, args, kwargs)
        if func.__name__.startswith("_foreach_"):
            return HANDLERS["foreach"](func, args, kwargs)
        refuse(f"{func.overloadpacket.__name__}()", _first(args, kwargs))


class ShardedGrad(ShardedRows):
    """This rank's rows of a parameter's averaged gradient (see [Note: a sharded gradient answers as the full
    one])."""

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"ShardedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, {self._where()}: "
                f"this rank's shard of the averaged gradient of {self._name})")

    def refusal(self, what: str) -> Exception:
        return ShardedGradientError(
            f"{what} on the gradient of {self._name!r}: outside the optimizer's step each rank holds only its rows "
            "of the averaged gradient, and this operation would need the other ranks' rows as values. Norms, "
            "clipping, element-wise edits, indexing and reductions work on it as on the full gradient; for anything "
            "else use `with trainer.strategy.gathered_gradients():` (every rank must enter it; edits made inside are "
            "kept)"
        )


def held_rows(tensor: Tensor) -> Tensor:
    """The memory behind ``tensor``: a ``ShardedRows``' rows, or the tensor itself (for memory accounting)."""
    return tensor._local if isinstance(tensor, ShardedRows) else tensor


def refuse(what: str, of: ShardedRows) -> None:
    """Raise ``of``'s error for ``what``, an operation that would need the other ranks' rows as values."""
    raise of.refusal(what)


def _first(args, kwargs) -> ShardedRows:
    return next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, ShardedRows))


def wrap(local: Tensor, layout: RowLayout, like: ShardedRows, key: int | None = None) -> ShardedRows:
    """``local`` rows of a tensor of ``layout``, with ``like``'s owner and name."""
    return type(like)(local, layout, like._owner, like._name, key)


def rows_of(value: Any, layout: RowLayout) -> Any:
    """A plain operand of an element-wise operation on tensors of ``layout``: its rows where it varies along the
    first dimension (a full-shape mask, a full gradient), as it is where it broadcasts over it."""
    if not isinstance(value, Tensor) or isinstance(value, ShardedRows) or layout.single:
        return value
    if value.dim() < len(layout.shape) or value.shape[0] == 1:
        return value
    if value.dim() > len(layout.shape) or value.shape[0] != layout.rows:
        raise ShardedGradientError(f"an operand of shape {tuple(value.shape)} does not broadcast to {tuple(layout.shape)}")
    return value.narrow(0, layout.lo, layout.hi - layout.lo)


def _written(func, args: Sequence[Any], kwargs: dict) -> list[Any]:
    """The arguments ``func`` writes into (``self`` of an in-place operation, ``out=``)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(args[i] if i < len(args) else kwargs.get(arg.name))
    return written


def element_wise(func, args, kwargs):
    sharded = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, ShardedRows)]
    layout = sharded[0]._layout
    first = sharded[0]
    if any(g._layout != layout for g in sharded):
        refuse(f"{func.overloadpacket.__name__}() between differently sharded tensors", first)
    written = _written(func, args, kwargs)
    if any(isinstance(w, Tensor) and not isinstance(w, ShardedRows) for w in written):
        refuse(f"writing it into a plain tensor ({func.overloadpacket.__name__}())", first)
    try:
        local_args, local_kwargs = tree_map(lambda v: v._local if isinstance(v, ShardedRows) else rows_of(v, layout),
                                            (args, kwargs))
    except ShardedGradientError as err:
        refuse(f"{func.overloadpacket.__name__}() with {err}", first)
    out = func(*local_args, **local_kwargs)
    if written:
        first._owner.changed(first._key, scaling_factor(func, args[1:]))
        return written[0] if len(written) == 1 else tuple(written)
    if isinstance(out, Tensor):
        if out.shape != layout.local_shape:
            refuse(f"{func.overloadpacket.__name__}() broadcasting it to a larger shape", first)
        result = wrap(out, layout, first)
        if func.overloadpacket is aten.abs and len(sharded) == 1:  # its largest value is a kept norm
            result._abs_of = whole_key(first)
        return result
    return out


def scaling_factor(func, operands: Sequence[Any]) -> Any:
    """What an in-place ``mul_``/``div_`` by one number or 0-d tensor multiplies by (``clip_grad_norm_``'s
    coefficient), else ``None``."""
    if func.overloadpacket not in (aten.mul_, aten.div_, aten._foreach_mul_, aten._foreach_div_) or len(operands) != 1:
        return None
    factor = operands[0]
    if isinstance(factor, Tensor) and (isinstance(factor, ShardedRows) or factor.dim() != 0):
        return None
    if not isinstance(factor, (Tensor, int, float)):
        return None
    is_div = func.overloadpacket in (aten.div_, aten._foreach_div_)
    return (1.0 / factor if not isinstance(factor, Tensor) else factor.reciprocal()) if is_div else factor


def whole_key(x: ShardedRows) -> int | None:
    """The key of the whole gradient ``x`` is, or is the absolute value of (its norms are kept: user_view.py)."""
    return x._key if x._key is not None else x._abs_of


#: What ``ShardedRows`` answers beyond the element-wise operations, by aten operator: filled by sharded_grad_ops.py
#: (imported with ``lightning_zero.sharding.user_view``, which makes every ``ShardedGrad``).
HANDLERS: dict[Any, Callable] = {}
#: Operators that work row by row without being tagged point-wise (fills, copies, clamps).
ELEMENT_WISE: set[Any] = set()
