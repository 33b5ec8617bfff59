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
  ``any``, ``equal``, ``item()``), combine the ranks' partial results with one all-reduce: **every rank must run
  them**, as every rank must clip the same way; the norm of each whole gradient is computed once for all gradients
  together and kept until a gradient changes, so ``clip_grad_norm_`` and ``grad_norm`` cost one all-reduce;
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
from dataclasses import dataclass, replace
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


    def changed(self) -> None:
        """Its rows were written in place."""

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
    _name: str

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local: Tensor, layout: RowLayout, owner: Reducer, name: str, key: int | None = None):
        if local.shape != layout.local_shape:
            raise AssertionError(f"{name}: local rows of shape {tuple(local.shape)}, layout {layout}")
        rows = torch.Tensor._make_wrapper_subclass(cls, layout.shape, dtype=local.dtype, device=local.device,
                                                   requires_grad=False)
        rows._local, rows._layout, rows._owner, rows._name, rows._key = local, layout, owner, name, key
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
        _refuse("tolist()", self)

    def numpy(self, *, force: bool = False):
        _refuse("numpy()", self)

    def __array__(self, *args, **kwargs):
        _refuse("converting it to a NumPy array", self)

    def __deepcopy__(self, memo):  # a module copied with them (copy.deepcopy) keeps them sharded
        copied = type(self)(self._local.clone(), self._layout, self._owner, self._name)
        if getattr(self, "_is_param", False):  # a parameter of a copy of a sharded model (nn.Parameter's flag)
            copied = torch.nn.Parameter(copied, self.requires_grad)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol):
        _refuse("pickling (torch.save)", self)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func.overloadpacket)
        if handler is not None:
            return handler(func, args, kwargs)
        if func.overloadpacket in _ELEMENT_WISE or torch.Tag.pointwise in func.tags:
            return _element_wise(func, args, kwargs)
        if func.__name__.startswith("_foreach_"):
            return _foreach(func, args, kwargs)
        _refuse(f"{func.overloadpacket.__name__}()", _first(args, kwargs))


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


def _refuse(what: str, of: ShardedRows) -> None:
    raise of.refusal(what)


def _first(args, kwargs) -> ShardedRows:
    return next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, ShardedRows))


def _wrap(local: Tensor, layout: RowLayout, like: ShardedRows, key: int | None = None) -> ShardedRows:
    return type(like)(local, layout, like._owner, like._name, key)


def _rows_of(value: Any, layout: RowLayout) -> Any:
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


def _element_wise(func, args, kwargs):
    grads = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, ShardedRows)]
    layout = grads[0]._layout
    name = grads[0]
    if any(g._layout != layout for g in grads):
        _refuse(f"{func.overloadpacket.__name__}() between differently sharded tensors", name)
    written = _written(func, args, kwargs)
    if any(isinstance(w, Tensor) and not isinstance(w, ShardedRows) for w in written):
        _refuse(f"writing it into a plain tensor ({func.overloadpacket.__name__}())", name)
    try:
        local_args, local_kwargs = tree_map(lambda v: v._local if isinstance(v, ShardedRows) else _rows_of(v, layout),
                                            (args, kwargs))
    except ShardedGradientError as err:
        _refuse(f"{func.overloadpacket.__name__}() with {err}", name)
    out = func(*local_args, **local_kwargs)
    if written:
        grads[0]._owner.changed()
        return written[0] if len(written) == 1 else tuple(written)
    if isinstance(out, Tensor):
        if out.shape != layout.local_shape:
            _refuse(f"{func.overloadpacket.__name__}() broadcasting it to a larger shape", name)
        return _wrap(out, layout, grads[0])
    return out


# ------------------------------------------------------------------------------------------------ reductions

_IDENTITY = {"sum": 0.0, "max": -math.inf, "min": math.inf}


def _all_dims(layout: RowLayout, dim: Any) -> tuple[list[int], bool]:
    """The local dimensions a reduction over ``dim`` (of the full tensor) reduces, and whether the rows are among
    them (then the ranks' partial results are combined)."""
    ndim = len(layout.shape)
    dims = _global_dims(torch.empty(layout.shape, device="meta"), dim) if ndim else []
    if layout.single:
        return [0] + [d + 1 for d in dims], True
    return dims, 0 in dims or ndim == 0


def _combine(x: ShardedRows, partial: Tensor, op: str, local_dims: list[int], keepdim: bool, single: bool) -> Tensor:
    """All-reduce each rank's ``partial`` (kept dims of size 1) with ``op``; drop the reduced dimensions."""
    work = partial.float() if partial.dtype in (torch.float16, torch.bfloat16) else partial
    combined = x._owner.all_reduce(work.contiguous(), op)
    if single:  # the virtual row dimension goes whatever keepdim says
        combined = combined.squeeze(0)
        local_dims = [d - 1 for d in local_dims if d > 0]
    if not keepdim and local_dims:
        combined = combined.squeeze(tuple(local_dims)) if combined.dim() else combined
    return combined


def _partial(local: Tensor, dims: list[int], op: str, p: float = 1.0) -> Tensor:
    """This rank's part of a reduction over ``dims`` (kept as size 1), the identity where it holds no rows."""
    if local.numel() == 0:
        shape = [1 if d in dims else s for d, s in enumerate(local.shape)]
        return torch.full(shape, _IDENTITY[op], dtype=torch.float64 if local.dtype == torch.float64 else
                          torch.float32, device=local.device)
    work = local.double() if local.dtype == torch.float64 else local.float()
    if p != 1.0:
        work = work.abs() if p in (math.inf, -math.inf) else work.abs().pow(p)
    if op == "sum":
        return work.sum(dim=dims, keepdim=True)
    return work.amax(dim=dims, keepdim=True) if op == "max" else work.amin(dim=dims, keepdim=True)


def _reduce(x: ShardedRows, dim, keepdim: bool, op: str, p: float, finish: Callable[[Tensor], Tensor], out_dtype,
            local_op: Callable[[Tensor], Tensor]) -> Any:
    dims, across = _all_dims(x._layout, dim)
    if not across:  # the rows stay: a sharded result
        out = local_op(x._local)
        shape = torch.Size((x._layout.shape[0], *out.shape[1:]))
        return _wrap(out, RowLayout(shape, x._layout.lo, x._layout.hi), x)
    combined = _combine(x, _partial(x._local, dims, op, p), op, dims, keepdim, x._layout.single)
    return finish(combined).to(out_dtype)


def _sum(func, args, kwargs):
    x, dim, keepdim, dtype = _args(func, args, kwargs, ("self", "dim", "keepdim", "dtype"), (None, None, False, None))
    out_dtype = dtype or (x.dtype if x.dtype.is_floating_point else torch.int64)
    return _reduce(x, dim, keepdim, "sum", 1.0, lambda t: t, out_dtype, lambda t: func(t, *args[1:], **kwargs))


def _mean(func, args, kwargs):
    x, dim, keepdim, dtype = _args(func, args, kwargs, ("self", "dim", "keepdim", "dtype"), (None, None, False, None))
    dims = _global_dims(x, dim)
    count = math.prod(x.shape[d] for d in dims)
    return _reduce(x, dim, keepdim, "sum", 1.0, lambda t: t / count, dtype or x.dtype,
                   lambda t: func(t, *args[1:], **kwargs))


def _global_dims(x: Tensor, dim: Any) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    return [d % x.dim() for d in ([dim] if isinstance(dim, int) else dim)]


def _extreme(op: str):
    def handler(func, args, kwargs):
        if func._overloadname in ("other", "out", "other_out"):  # torch.max(a, b): element-wise
            return _element_wise(func, args, kwargs)
        x, dim, keepdim = _args(func, args, kwargs, ("self", "dim", "keepdim"), (None, None, False))
        if func._overloadname in ("dim", "dim_max", "dim_min"):  # (values, indices): indices are one rank's
            if _all_dims(x._layout, dim)[1]:
                _refuse(f"{func.overloadpacket.__name__}(dim=...) over the rows (it returns indices)", x)
            values, indices = func(x._local, *args[1:], **kwargs)
            shape = torch.Size((x._layout.shape[0], *values.shape[1:]))
            layout = RowLayout(shape, x._layout.lo, x._layout.hi)
            return _wrap(values, layout, x), _wrap(indices, layout, x)
        return _reduce(x, dim, keepdim, op, 1.0, lambda t: t, x.dtype, lambda t: func(t, *args[1:], **kwargs))

    return handler


def _vector_norm(func, args, kwargs):
    x, ord, dim, keepdim, dtype = _args(func, args, kwargs, ("self", "ord", "dim", "keepdim", "dtype"),
                                        (None, 2.0, None, False, None))
    ord = float(ord)
    out_dtype = dtype or x.dtype
    if x._key is not None and dim is None and not keepdim and ord in (2.0, math.inf):
        return x._owner.whole_norms(ord)[x._key].to(out_dtype)  # computed for every gradient at once
    if ord == 0.0:
        op, p, finish = "sum", 1.0, lambda t: t
        x = _wrap((x._local != 0).to(torch.float32), x._layout, x)
    elif ord in (math.inf, -math.inf):
        op, p, finish = ("max" if ord > 0 else "min"), ord, lambda t: t
    else:
        op, p, finish = "sum", ord, lambda t: t.pow(1.0 / ord)
    return _reduce(x, dim, keepdim, op, p, finish, out_dtype, lambda t: func(t, *args[1:], **kwargs))


def _truth(op: str):
    def handler(func, args, kwargs):
        x, dim, keepdim = _args(func, args, kwargs, ("self", "dim", "keepdim"), (None, None, False))
        flag = _wrap((x._local != 0).to(torch.float32), x._layout, x)
        return _reduce(flag, dim, keepdim, op, 1.0, lambda t: t, torch.bool, lambda t: func(t, *args[1:], **kwargs))

    return handler


def _count_nonzero(func, args, kwargs):
    x, dim = _args(func, args, kwargs, ("self", "dim"), (None, None))
    flag = _wrap((x._local != 0).to(torch.float32), x._layout, x)
    return _reduce(flag, dim, False, "sum", 1.0, lambda t: t, torch.int64, lambda t: func(t, *args[1:], **kwargs))


def _equal(func, args, kwargs):
    a, b = args[0], args[1]
    if not isinstance(a, ShardedRows):
        a, b = b, a
    if a.shape != b.shape:
        return False
    same = torch.equal(a._local, b._local if isinstance(b, ShardedRows) else _rows_of(b, a._layout))
    flag = torch.tensor([float(same)], device=a.device)
    return bool(a._owner.all_reduce(flag, "min").item())


def _item(func, args, kwargs):
    x = args[0]
    if x.numel() != 1:
        _refuse("item()", x)
    total = x._owner.all_reduce(x._local.reshape(-1).double().sum().reshape(1), "sum")
    value = total.to(x.dtype)
    return value.item() if func.overloadpacket is aten._local_scalar_dense else bool(value.item())


def _args(func, args, kwargs, names: tuple[str, ...], defaults: tuple) -> list[Any]:
    """``names``' values in a call of ``func`` (positional or keyword), ``defaults`` where absent."""
    schema = [a.name for a in func._schema.arguments]
    values = []
    for name, default in zip(names, defaults):
        if name in kwargs:
            values.append(kwargs[name])
        elif name in schema and schema.index(name) < len(args):
            values.append(args[schema.index(name)])
        else:
            values.append(default)
    return values


# ----------------------------------------------------------------------------------------------------- views


def _alias(func, args, kwargs):
    x = args[0]
    return _wrap(func(x._local), x._layout, x, x._key)


def _in_place_alias(func, args, kwargs):
    return args[0]  # detach_, requires_grad_ on a gradient: nothing to do


def _slice(func, args, kwargs):
    x, dim, start, end, step = _args(func, args, kwargs, ("self", "dim", "start", "end", "step"), (None, 0, None, None, 1))
    layout = x._layout
    dim %= x.dim()
    if layout.single or dim != 0:
        local = func(x._local, dim + 1 if layout.single else dim, start, end, step)
        shape = func(torch.empty(x.shape, device="meta"), dim, start, end, step).shape
        return _wrap(local, replace(layout, shape=shape), x)
    if step != 1:
        _refuse("a strided slice of the first dimension", x)
    start, end, _ = slice(start, end).indices(layout.rows)
    end = max(end, start)
    narrowed = layout.narrowed(start, end)
    local = x._local.narrow(0, narrowed.lo + start - layout.lo, narrowed.hi - narrowed.lo)
    return _wrap(local, narrowed, x)


def _select(func, args, kwargs):
    x, dim, index = _args(func, args, kwargs, ("self", "dim", "index"), (None, 0, 0))
    layout = x._layout
    dim %= x.dim()
    if layout.single or dim != 0:
        local = func(x._local, dim + 1 if layout.single else dim, index)
        shape = func(torch.empty(x.shape, device="meta"), dim, index).shape
        return _wrap(local, replace(layout, shape=shape), x)
    index %= layout.rows
    picked = layout.picked(index)
    local = x._local.narrow(0, index - layout.lo, 1) if picked.hi else x._local.narrow(0, 0, 0).reshape(0, *layout.shape[1:])
    return _wrap(local, picked, x)


def _view(func, args, kwargs):
    x, size = args[0], args[1]
    layout = x._layout
    shape = torch.empty(x.shape, device="meta").view(size).shape if -1 in list(size) else torch.Size(size)
    if layout.single or len(shape) == 0:
        _refuse(f"a view of shape {tuple(shape)}", x)
    old_row, new_row = layout.row_numel, math.prod(shape[1:])
    first, last = layout.lo * old_row, layout.hi * old_row
    if new_row == 0 or first % new_row or last % new_row:
        _refuse(f"a view of shape {tuple(shape)} that splits this rank's rows", x)
    new = RowLayout(shape, first // new_row, last // new_row)
    return _wrap(x._local.reshape(new.local_shape), new, x)


def _unsqueeze(func, args, kwargs):
    x, dim = args[0], args[1]
    if x._layout.single or dim % (x.dim() + 1) == 0:
        _refuse("unsqueeze() in front of the first dimension", x)
    dim %= x.dim() + 1
    shape = torch.Size((*x.shape[:dim], 1, *x.shape[dim:]))
    return _wrap(x._local.unsqueeze(dim), replace(x._layout, shape=shape), x)


def _index_put(func, args, kwargs):
    x, indices, values, accumulate = _args(func, args, kwargs, ("self", "indices", "values", "accumulate"),
                                           (None, None, None, False))
    layout = x._layout
    if layout.single or not indices:
        _refuse("indexed assignment", x)
    first, rest = indices[0], list(indices[1:])
    if torch.is_tensor(values) and values.dim() > 0 and not (first is None and values.numel() == 1):
        if first is not None:
            _refuse("indexed assignment of several values", x)
    if first is None:
        local_indices = [None, *rest]
        values = _rows_of(values, layout) if torch.is_tensor(values) and values.dim() == x.dim() else values
    elif first.dtype == torch.bool:
        local_indices = [_rows_of(first, RowLayout(first.shape, layout.lo, layout.hi)), *rest]
    else:
        index = first % layout.rows
        mine = (index >= layout.lo) & (index < layout.hi)
        local_indices = [index[mine] - layout.lo, *[r[mine] if torch.is_tensor(r) else r for r in rest]]
    func(x._local, local_indices, values, accumulate)
    x._owner.changed()
    return x


# ---------------------------------------------------------------------------------------------- new tensors


def _like(func, args, kwargs):
    """``empty_like``/``zeros_like``/...: the same rows, made locally; a random draw is made full (the same numbers
    DDP's rank draws) and this rank's rows kept."""
    x = args[0]
    if func.overloadpacket in _RANDOM:
        full = func(torch.empty(x.shape, dtype=x.dtype, device=x.device), *args[1:], **kwargs)
        return _wrap(_rows_of(full, x._layout).clone(), x._layout, x)
    return _wrap(func(x._local, *args[1:], **kwargs), x._layout, x)


def _random_fill(func, args, kwargs):
    x = args[0]
    full = func(torch.empty(x.shape, dtype=x.dtype, device=x.device), *args[1:], **kwargs)
    x._local.copy_(full.reshape(x._layout.rows, -1)[x._layout.lo : x._layout.hi].view(x._local.shape)
                   if not x._layout.single else (full.reshape(x._local.shape[1:]).unsqueeze(0) if x._layout.hi else
                                                 x._local))
    x._owner.changed()
    return x


def _new(func, args, kwargs):
    """``new_zeros(size)`` and the like: a plain tensor (no values of the gradient are read)."""
    x = args[0]
    return func(torch.empty(0, dtype=x.dtype, device=x.device), *args[1:], **kwargs)


def _foreach(func, args, kwargs):
    """A ``_foreach_`` operation: on the rows of the sharded tensors among the first list's, on the plain ones (a
    module's buffers averaged with its parameters) as they are."""
    lists = [a for a in args if isinstance(a, (list, tuple))]
    first = list(lists[0]) if lists else []
    sharded = [t for t in first if isinstance(t, ShardedRows)]
    layouts = [t._layout if isinstance(t, ShardedRows) else None for t in first]
    for arg in lists[1:]:
        if any(isinstance(v, ShardedRows) and layout is None for v, layout in zip(arg, layouts)):
            _refuse(f"writing it into a plain tensor ({func.overloadpacket.__name__}())",
                    next(v for v in arg if isinstance(v, ShardedRows)))

    def local(arg):
        if isinstance(arg, (list, tuple)):
            return [v._local if isinstance(v, ShardedRows) else v if layout is None else _rows_of(v, layout)
                    for v, layout in zip(arg, layouts)]
        return arg

    out = func(*[local(a) for a in args], **kwargs)
    if func._schema.is_mutable:
        if sharded:
            sharded[0]._owner.changed()
        return None
    return [o if layout is None else _wrap(o, layout, t) for o, layout, t in zip(out, layouts, first)]


def _foreach_norm(func, args, kwargs):
    tensors, ord = args[0], float(args[1] if len(args) > 1 else kwargs.get("ord", 2.0))
    return [torch.linalg.vector_norm(t, ord) for t in tensors]


_ELEMENT_WISE = {
    aten.fill_, aten.zero_, aten.copy_, aten.masked_fill_, aten.masked_fill, aten.where, aten.clone, aten._to_copy,
    aten.contiguous, aten.clamp_, aten.clamp, aten.clamp_min_, aten.clamp_max_, aten.nan_to_num_, aten.nan_to_num,
}
_RANDOM = {aten.randn_like, aten.rand_like, aten.randint_like}

_HANDLERS: dict[Any, Callable] = {
    aten.sum: _sum, aten.mean: _mean, aten.amax: _extreme("max"), aten.amin: _extreme("min"),
    aten.max: _extreme("max"), aten.min: _extreme("min"), aten.linalg_vector_norm: _vector_norm,
    aten.all: _truth("min"), aten.any: _truth("max"), aten.count_nonzero: _count_nonzero, aten.equal: _equal,
    aten._local_scalar_dense: _item, aten.is_nonzero: _item,
    aten.detach: _alias, aten.alias: _alias, aten.detach_: _in_place_alias,
    aten.slice: _slice, aten.select: _select, aten.view: _view, aten._unsafe_view: _view, aten.reshape: _view,
    aten.unsqueeze: _unsqueeze, aten.index_put_: _index_put, aten.index_put: _index_put,
    aten.empty_like: _like, aten.zeros_like: _like, aten.ones_like: _like, aten.full_like: _like,
    aten.randn_like: _like, aten.rand_like: _like, aten.randint_like: _like,
    aten.normal_: _random_fill, aten.uniform_: _random_fill, aten.bernoulli_: _random_fill,
    aten.new_zeros: _new, aten.new_empty: _new, aten.new_ones: _new, aten.new_full: _new,
    aten._foreach_norm: _foreach_norm,
}
