"""The operations a ``ShardedRows`` answers beyond element-wise ones (sharded_grad.py, [Note: a sharded gradient
answers as the full one]): reductions over the ranks' rows, views and indexing in the full tensor's indices, new
tensors like it, and foreach operations. Each registers itself in ``sharded_grad.HANDLERS``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from lightning_zero.sharding.sharded_grad import (
    ELEMENT_WISE,
    HANDLERS,
    RowLayout,
    ShardedRows,
    element_wise,
    refuse,
    rows_of,
    scaling_factor,
    whole_key,
    wrap,
)

aten = torch.ops.aten

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


def _combine(x: ShardedRows, partial: Tensor, op: str, local_dims: list[int], keepdim: bool, single: bool,
             call: str) -> Tensor:
    """All-reduce each rank's ``partial`` (kept dims of size 1) with ``op``; drop the reduced dimensions."""
    work = partial.float() if partial.dtype in (torch.float16, torch.bfloat16) else partial
    combined = x._owner.all_reduce(work.contiguous(), op, x, call)
    if single:  # the virtual row dimension goes whatever keepdim says
        combined = combined.squeeze(0)
        local_dims = [d - 1 for d in local_dims if d > 0]
    if not keepdim and local_dims:
        combined = combined.squeeze(tuple(local_dims)) if combined.dim() else combined
    return combined


def _partial(local: Tensor, dims: list[int], op: str, p: float | None = None) -> Tensor:
    """This rank's part of a reduction over ``dims`` (kept as size 1), the identity where it holds no rows."""
    if local.numel() == 0:
        shape = [1 if d in dims else s for d, s in enumerate(local.shape)]
        return torch.full(shape, _IDENTITY[op], dtype=torch.float64 if local.dtype == torch.float64 else
                          torch.float32, device=local.device)
    work = local.double() if local.dtype == torch.float64 else local.float()
    if p is not None:  # a norm's: |x|, or |x|**p
        work = work.abs() if p in (math.inf, -math.inf) else work.abs().pow(p)
    if op == "sum":
        return work.sum(dim=dims, keepdim=True)
    return work.amax(dim=dims, keepdim=True) if op == "max" else work.amin(dim=dims, keepdim=True)


def _reduce(x: ShardedRows, dim, keepdim: bool, op: str, p: float | None, finish: Callable[[Tensor], Tensor], out_dtype,
            call: tuple) -> Any:
    """``call`` (``func, args, kwargs``), a reduction of ``x`` over ``dim`` with ``op``: on the rows where they stay,
    else each rank's partial (``|x|**p`` for a norm) combined across the ranks and ``finish``-ed."""
    func, args, kwargs = call
    dims, across = _all_dims(x._layout, dim)
    if not across:  # the rows stay: a sharded result
        out = func(x._local, *args[1:], **kwargs)
        shape = torch.Size((x._layout.shape[0], *out.shape[1:]))
        return wrap(out, RowLayout(shape, x._layout.lo, x._layout.hi), x)
    combined = _combine(x, _partial(x._local, dims, op, p), op, dims, keepdim, x._layout.single, _call(func))
    return finish(combined).to(out_dtype)


def _sum(func, args, kwargs):
    x, dim, keepdim, dtype = _args(func, args, kwargs, ("self", "dim", "keepdim", "dtype"), (None, None, False, None))
    out_dtype = dtype or (x.dtype if x.dtype.is_floating_point else torch.int64)
    return _reduce(x, dim, keepdim, "sum", None, lambda t: t, out_dtype, (func, args, kwargs))


def _mean(func, args, kwargs):
    x, dim, keepdim, dtype = _args(func, args, kwargs, ("self", "dim", "keepdim", "dtype"), (None, None, False, None))
    dims = _global_dims(x, dim)
    count = math.prod(x.shape[d] for d in dims)
    return _reduce(x, dim, keepdim, "sum", None, lambda t: t / count, dtype or x.dtype,
                   (func, args, kwargs))


def _global_dims(x: Tensor, dim: Any) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    return [d % x.dim() for d in ([dim] if isinstance(dim, int) else dim)]


def _extreme(op: str):
    def handler(func, args, kwargs):
        if func._overloadname in ("other", "out", "other_out"):  # torch.max(a, b): element-wise
            return element_wise(func, args, kwargs)
        x, dim, keepdim = _args(func, args, kwargs, ("self", "dim", "keepdim"), (None, None, False))
        if func._overloadname in ("dim", "dim_max", "dim_min"):  # (values, indices): indices are one rank's
            if _all_dims(x._layout, dim)[1]:
                refuse(f"{func.overloadpacket.__name__}(dim=...) over the rows (it returns indices)", x)
            values, indices = func(x._local, *args[1:], **kwargs)
            shape = torch.Size((x._layout.shape[0], *values.shape[1:]))
            layout = RowLayout(shape, x._layout.lo, x._layout.hi)
            return wrap(values, layout, x), wrap(indices, layout, x)
        if op == "max" and x._abs_of is not None and not keepdim and len(_global_dims(x, dim)) == x.dim():
            return x._owner.whole_norms(math.inf)[x._abs_of].to(x.dtype)  # p.grad.abs().max(): kept, no collective
        return _reduce(x, dim, keepdim, op, None, lambda t: t, x.dtype, (func, args, kwargs))

    return handler


def _vector_norm(func, args, kwargs):
    x, ord, dim, keepdim, dtype = _args(func, args, kwargs, ("self", "ord", "dim", "keepdim", "dtype"),
                                        (None, 2.0, None, False, None))
    ord = float(ord)
    out_dtype = dtype or x.dtype
    if whole_key(x) is not None and dim is None and not keepdim and ord in (2.0, math.inf):
        return x._owner.whole_norms(ord)[whole_key(x)].to(out_dtype)  # kept for every gradient at once
    if ord == 0.0:
        op, p, finish = "sum", None, lambda t: t
        x = wrap((x._local != 0).to(torch.float32), x._layout, x)
    elif ord in (math.inf, -math.inf):
        op, p, finish = ("max" if ord > 0 else "min"), ord, lambda t: t
    else:
        op, p, finish = "sum", ord, lambda t: t.pow(1.0 / ord)
    return _reduce(x, dim, keepdim, op, p, finish, out_dtype, (func, args, kwargs))


def _truth(op: str):
    def handler(func, args, kwargs):
        x, dim, keepdim = _args(func, args, kwargs, ("self", "dim", "keepdim"), (None, None, False))
        flag = wrap((x._local != 0).to(torch.float32), x._layout, x)
        return _reduce(flag, dim, keepdim, op, None, lambda t: t, torch.bool, (func, args, kwargs))

    return handler


def _count_nonzero(func, args, kwargs):
    x, dim = _args(func, args, kwargs, ("self", "dim"), (None, None))
    flag = wrap((x._local != 0).to(torch.float32), x._layout, x)
    return _reduce(flag, dim, False, "sum", None, lambda t: t, torch.int64, (func, args, kwargs))


def _equal(func, args, kwargs):
    a, b = args[0], args[1]
    if not isinstance(a, ShardedRows):
        a, b = b, a
    if a.shape != b.shape:
        return False
    same = torch.equal(a._local, b._local if isinstance(b, ShardedRows) else rows_of(b, a._layout))
    flag = torch.tensor([float(same)], device=a.device)
    return bool(a._owner.all_reduce(flag, "min", a, "torch.equal()").item())


def _item(func, args, kwargs):
    x = args[0]
    if x.numel() != 1:
        refuse("item()", x)
    total = x._owner.all_reduce(x._local.reshape(-1).double().sum().reshape(1), "sum", x, _call(func))
    value = total.to(x.dtype)
    return value.item() if func.overloadpacket is aten._local_scalar_dense else bool(value.item())


#: What user code calls the operators whose aten names differ.
_CALLS = {"linalg_vector_norm": "norm", "_local_scalar_dense": "item", "is_nonzero": "bool"}


def _call(func) -> str:
    """``func`` as user code calls it, for messages: ``sum()``, ``norm()``."""
    name = func.overloadpacket.__name__
    return f"{_CALLS.get(name, name)}()"


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
    return wrap(func(x._local), x._layout, x, x._key)


def _in_place_alias(func, args, kwargs):
    return args[0]  # detach_, requires_grad_ on a gradient: nothing to do


def _slice(func, args, kwargs):
    x, dim, start, end, step = _args(func, args, kwargs, ("self", "dim", "start", "end", "step"), (None, 0, None, None, 1))
    layout = x._layout
    dim %= x.dim()
    if layout.single or dim != 0:
        local = func(x._local, dim + 1 if layout.single else dim, start, end, step)
        shape = func(torch.empty(x.shape, device="meta"), dim, start, end, step).shape
        return wrap(local, replace(layout, shape=shape), x)
    if step != 1:
        refuse("a strided slice of the first dimension", x)
    start, end, _ = slice(start, end).indices(layout.rows)
    end = max(end, start)
    narrowed = layout.narrowed(start, end)
    local = x._local.narrow(0, narrowed.lo + start - layout.lo, narrowed.hi - narrowed.lo)
    return wrap(local, narrowed, x)


def _select(func, args, kwargs):
    x, dim, index = _args(func, args, kwargs, ("self", "dim", "index"), (None, 0, 0))
    layout = x._layout
    dim %= x.dim()
    if layout.single or dim != 0:
        local = func(x._local, dim + 1 if layout.single else dim, index)
        shape = func(torch.empty(x.shape, device="meta"), dim, index).shape
        return wrap(local, replace(layout, shape=shape), x)
    index %= layout.rows
    picked = layout.picked(index)
    local = x._local.narrow(0, index - layout.lo, 1) if picked.hi else x._local.narrow(0, 0, 0).reshape(0, *layout.shape[1:])
    return wrap(local, picked, x)


def _view(func, args, kwargs):
    x, size = args[0], args[1]
    layout = x._layout
    shape = torch.empty(x.shape, device="meta").view(size).shape if -1 in list(size) else torch.Size(size)
    if layout.single or len(shape) == 0:
        refuse(f"a view of shape {tuple(shape)}", x)
    old_row, new_row = layout.row_numel, math.prod(shape[1:])
    first, last = layout.lo * old_row, layout.hi * old_row
    if new_row == 0 or first % new_row or last % new_row:
        refuse(f"a view of shape {tuple(shape)} that splits this rank's rows", x)
    new = RowLayout(shape, first // new_row, last // new_row)
    return wrap(x._local.reshape(new.local_shape), new, x)


def _unsqueeze(func, args, kwargs):
    x, dim = args[0], args[1]
    if x._layout.single or dim % (x.dim() + 1) == 0:
        refuse("unsqueeze() in front of the first dimension", x)
    dim %= x.dim() + 1
    shape = torch.Size((*x.shape[:dim], 1, *x.shape[dim:]))
    return wrap(x._local.unsqueeze(dim), replace(x._layout, shape=shape), x)


def _index_put(func, args, kwargs):
    x, indices, values, accumulate = _args(func, args, kwargs, ("self", "indices", "values", "accumulate"),
                                           (None, None, None, False))
    layout = x._layout
    if layout.single or not indices:
        refuse("indexed assignment", x)
    first, rest = indices[0], list(indices[1:])
    if torch.is_tensor(values) and values.dim() > 0 and not (first is None and values.numel() == 1):
        if first is not None:
            refuse("indexed assignment of several values", x)
    if first is None:
        local_indices = [None, *rest]
        values = rows_of(values, layout) if torch.is_tensor(values) and values.dim() == x.dim() else values
    elif first.dtype == torch.bool:
        local_indices = [rows_of(first, RowLayout(first.shape, layout.lo, layout.hi)), *rest]
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
        return wrap(rows_of(full, x._layout).clone(), x._layout, x)
    return wrap(func(x._local, *args[1:], **kwargs), x._layout, x)


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
            refuse(f"writing it into a plain tensor ({func.overloadpacket.__name__}())",
                   next(v for v in arg if isinstance(v, ShardedRows)))

    def local(arg):
        if isinstance(arg, (list, tuple)):
            return [v._local if isinstance(v, ShardedRows) else v if layout is None else rows_of(v, layout)
                    for v, layout in zip(arg, layouts)]
        return arg

    out = func(*[local(a) for a in args], **kwargs)
    if func._schema.is_mutable:
        factor = scaling_factor(func, args[1:])
        for tensor in sharded if factor is not None else sharded[:1]:
            tensor._owner.changed(tensor._key, factor)
        return None
    return [o if layout is None else wrap(o, layout, t) for o, layout, t in zip(out, layouts, first)]


def _foreach_norm(func, args, kwargs):
    tensors, ord = args[0], float(args[1] if len(args) > 1 else kwargs.get("ord", 2.0))
    return [torch.linalg.vector_norm(t, ord) for t in tensors]


ELEMENT_WISE.update({
    aten.fill_, aten.zero_, aten.copy_, aten.masked_fill_, aten.masked_fill, aten.where, aten.clone, aten._to_copy,
    aten.contiguous, aten.clamp_, aten.clamp, aten.clamp_min_, aten.clamp_max_, aten.nan_to_num_, aten.nan_to_num,
})
_RANDOM = {aten.randn_like, aten.rand_like, aten.randint_like}

HANDLERS.update({
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
    "foreach": _foreach,
})
