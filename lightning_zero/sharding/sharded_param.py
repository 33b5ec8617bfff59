"""What a stage-3 parameter is between its uses: the module's own ``nn.Parameter``, with its full shape and no values.

[Note: a sharded parameter keeps its shape]
Between a unit's uses, its parameters hold no values on this rank (the rows it owns live in ``ParamShard.local``),
yet code outside the forward asks them for what it would under DDP: ``sum(p.numel() for p in model.parameters())``,
Lightning's ``ModelSummary`` (and any subclass of it), ``p.shape``, the keys and shapes of ``model.state_dict()``. So
a sharded parameter is given, as its ``.data``, a tensor of its full shape, dtype and device that costs one element
(``placeholder``: a single NaN, or 0 for integers, expanded to the shape), and its class becomes a subclass of its
own (``sharded_class``: ``isinstance(p, nn.Parameter)`` still holds, and the object is the same one the optimizer and
every module refer to) whose ``__torch_function__`` answers metadata (shape, dtype, device, ``numel``,
``requires_grad``, its gradient, hooks) and refuses everything that reads or writes values, naming the parameter and
the way out: ``trainer.strategy.gathered_parameters()`` makes the parameters whole, and edits made inside are kept.
This is the shape FSDP2's DTensor parameters give ``numel`` and ``shape``, without DTensor's per-operation dispatch:
a gathered parameter is restored to its own class, so the forward and backward run on plain parameters at no cost.

``torch.equal`` between two parameters answers by identity: Lightning's ``BaseFinetuning`` looks a parameter up
among an optimizer's with it (under DDP by value, which is the same answer unless two parameters hold equal values).
One door stays open and is documented: ``p.data`` and ``p.detach()`` (what ``state_dict()`` holds) give the
placeholder, whose values are NaN, so that ``state_dict()`` has the model's keys and shapes. The runtime itself reads
values only where it has restored the class (the optimizer step, a gather, the end of fit).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

#: What may be asked of a sharded parameter: metadata, its gradient, hooks, its ``.data`` (swapped by the runtime),
#: identity (hashing, ``is``-equality), a detached copy (itself guarded).
_METADATA = frozenset({
    "shape", "size", "dim", "ndim", "numel", "nelement", "dtype", "device", "layout", "is_cuda", "is_meta",
    "is_cpu", "is_floating_point", "is_complex", "is_signed", "element_size", "itemsize", "nbytes", "requires_grad",
    "requires_grad_", "grad", "_grad", "grad_fn", "is_leaf", "data", "_version", "register_hook",
    "register_post_accumulate_grad_hook", "_backward_hooks", "_post_accumulate_grad_hooks", "untyped_storage",
    "data_ptr", "is_sparse", "names", "__hash__", "__eq__", "detach", "__format__", "output_nr", "_base",
    "is_contiguous", "stride", "storage_offset", "get_device", "_is_view", "is_quantized", "is_nested", "is_shared",
    "is_pinned",
    # new tensors made from the metadata alone (an optimizer's state made in its constructor: Adagrad's sums)
    "empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones", "new_full",
})


class ShardedParameterError(RuntimeError):
    """A stage-3 parameter's values were read (or written) outside a gathered scope."""


class _Sharded:
    """Mixed into a parameter's class between its uses (see [Note: a sharded parameter keeps its shape])."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__", "__delete__"):  # a property's accessor: judged by the property's name
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in _METADATA:
            return super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.equal and all(isinstance(a, nn.Parameter) for a in args):
            return args[0] is args[1]  # a parameter looked up among an optimizer's (BaseFinetuning): by identity
        raise ShardedParameterError(
            f"{name or func}() on a zero3 parameter outside a gathered scope: between its unit's uses a parameter "
            "holds only its shape (this rank's rows live in the optimizer's shards). Read or edit parameters inside "
            "`with trainer.strategy.gathered_parameters():` (every rank must enter it; edits made inside are kept), "
            "or use strategy='zero2' or 'zero1', which keep full parameters on every rank"
        )

    def __repr__(self) -> str:
        return (f"zero3 sharded {type(self).__mro__[2].__name__} of shape {tuple(self.shape)} and dtype "
                f"{self.dtype} (values only inside trainer.strategy.gathered_parameters())")


@functools.lru_cache(maxsize=None)
def sharded_class(cls: type) -> type:
    """The class a parameter of class ``cls`` takes between its uses: ``cls`` with reads refused."""
    return type(f"Sharded{cls.__name__}", (_Sharded, cls), {"__module__": __name__})


@functools.lru_cache(maxsize=None)
def _one_element(dtype: torch.dtype, device: torch.device) -> Tensor:
    value = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full((1,), value, dtype=dtype, device=device)


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of ``shape``, ``dtype`` and ``device`` holding one element (NaN, or 0), for a parameter's ``.data``
    between its uses; writing it in place fails (every element is the same memory)."""
    if len(shape) == 0:
        return _one_element(dtype, torch.device(device)).clone().view(())
    return _one_element(dtype, torch.device(device)).expand(shape)


def is_sharded(param: nn.Parameter) -> bool:
    return isinstance(param, _Sharded)
