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
``p.data`` and ``p.detach()`` (what ``state_dict()`` holds) give this rank's rows of the values, answering as the full
tensor would: see [Note: a parameter's values between its uses]. The runtime itself reads the placeholder
(``plain_data``) or values only where it has restored the class (the optimizer step, a gather, the end of fit).

[Note: a parameter's values between its uses]
Code written for DDP reads and writes whole parameters between steps through ``p.data`` and ``p.detach()``:
Lightning's ``WeightAveraging`` (EMA) averages ``p.detach()`` after every step and swaps the average in with
``p.data.copy_(...)`` for validation, ``StochasticWeightAveraging`` copies its average in with
``p.detach().copy_(...)``, ``state_dict()`` holds ``p.detach()``. Under stage 3 these give a ``ShardedValues``: this
rank's rows of the parameter's values, with the full shape, answering as the full tensor would, as a sharded gradient
does ([Note: a sharded gradient answers as the full one] in sharded_grad.py): element-wise arithmetic, ``copy_`` from
a full tensor or from another ``ShardedValues`` of the same layout, reductions (one all-reduce, which every rank must
run), and refusing what needs the other ranks' rows by name. Its rows are the ones the optimizer steps: the fp32
master under mixed precision (its dtype is then fp32, as DDP's parameter is), on the host or on disk when offloaded;
what is written into them is what the next gather reads (``UserView``: an offload pushes the written masters to
where the gathers read them). ``p.data = v`` with such a ``v`` (``p.data = copy.data``) takes ``v``'s rows, which the
master then aliases where it can, as DDP's parameter aliases ``v`` (``ParamShard.take_rows``). A copy of the module
made before it was sharded (the callbacks' averages) is sharded the same way (``UserView.shard_copy``): 4Ψ/N bytes
per rank for an fp32 average, not 4Ψ; a copy user code makes of the sharded module during fit (``copy.deepcopy``,
torch's ``AveragedModel``) holds rows from the start, and is whole inside ``gathered_parameters()`` and after fit
([Note: a user's copy of a sharded module] in user_copies.py). The parameter itself still refuses value reads (``p.sum()``): only its values,
explicitly taken, are answered from rows. Not answered: copying them into a plain tensor (EMA's swap for a validation
loop that gathers the whole model because ranks run different numbers of batches is refused by that name).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_zero.sharding.sharded_grad import ShardedRows

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


class ValuesOwner(Protocol):
    """Who answers for a sharded parameter's values (``user_view.UserView``)."""

    def values(self, param: nn.Parameter) -> ShardedValues | None:
        """``param``'s values as this rank's rows, or ``None`` if it answers for them no more."""

    def take_rows(self, param: nn.Parameter, values: ShardedRows) -> None:
        """``param.data = values``: the parameter's rows become ``values``' rows."""


#: Who answers for each parameter's values between its uses (see [Note: a parameter's values between its uses]),
#: held weakly both ways: neither the parameter nor its runtime is kept alive by it.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def answer_values(param: nn.Parameter, owner: ValuesOwner) -> None:
    _OWNERS[param] = weakref.ref(owner)


def _owner(param: Tensor) -> ValuesOwner | None:
    ref = _OWNERS.get(param)
    return ref() if ref is not None else None


class CopyMaker(Protocol):
    """Who makes a user's copy of a sharded parameter (``user_copies.UserCopies``)."""

    def copy(self, param: nn.Parameter) -> Tensor | None:
        """``copy.deepcopy(param)`` as this rank's rows, or ``None`` if it makes copies of it no more."""


#: Who copies each parameter between its uses (see [Note: a user's copy of a sharded module] in user_copies.py).
_COPY_MAKERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def copy_with(param: nn.Parameter, maker: CopyMaker) -> None:
    _COPY_MAKERS[param] = weakref.ref(maker)


def plain_data(param: nn.Parameter) -> Tensor:
    """``param.detach()`` as the runtime sees it: the placeholder of a sharded parameter, not its values."""
    with torch._C.DisableTorchFunctionSubclass():
        return param.detach()


class ShardedValues(ShardedRows):
    """This rank's rows of a stage-3 parameter's values between its uses (see [Note: a parameter's values between its
    uses])."""

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"ShardedValues(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"{self._where()}: this rank's rows of the zero3 parameter {self._name})")

    def refusal(self, what: str) -> Exception:
        return ShardedParameterError(
            f"{what} on the values of zero3 parameter {self._name!r} outside a gathered scope: between its unit's "
            "uses each rank holds only its rows, and this operation would need the other ranks' rows as values. "
            "Element-wise arithmetic, copies and reductions work on them as on the full tensor; for anything else "
            "use `with trainer.strategy.gathered_parameters():` (every rank must enter it; edits made inside are "
            "kept), or strategy='zero2' or 'zero1', which keep full parameters on every rank"
        )


class _Sharded:
    """Mixed into a parameter's class between its uses (see [Note: a sharded parameter keeps its shape])."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = accessor = getattr(func, "__name__", "")
        if name in ("__get__", "__set__", "__delete__"):  # a property's accessor: judged by the property's name
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        answered = _answer_values(name, accessor, args)
        if answered is not _UNANSWERED:
            return answered
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

    def __deepcopy__(self, memo: dict) -> Any:
        """``copy.deepcopy`` between its uses (``AveragedModel(model)``): this rank's rows of a copy of its values,
        which its maker makes whole where user code needs it (see [Note: a user's copy of a sharded module])."""
        if id(self) in memo:
            return memo[id(self)]
        ref = _COPY_MAKERS.get(self)
        maker = ref() if ref is not None else None
        copied = maker.copy(self) if maker is not None else None
        if copied is None:
            return super().__deepcopy__(memo)
        memo[id(self)] = copied
        return copied

    def __repr__(self) -> str:
        return (f"zero3 sharded {type(self).__mro__[2].__name__} of shape {tuple(self.shape)} and dtype "
                f"{self.dtype} (values only inside trainer.strategy.gathered_parameters())")


_UNANSWERED = object()


def _answer_values(name: str, accessor: str, args: tuple) -> Any:
    """``p.detach()``, ``p.data``, ``p.data = values`` of a sharded parameter whose owner answers for its values."""
    if name not in ("detach", "data") or not args or accessor == "__delete__":
        return _UNANSWERED
    owner = _owner(args[0])
    if owner is None:
        return _UNANSWERED
    if accessor == "__set__":
        if not isinstance(args[1], ShardedRows):
            return _UNANSWERED  # a full tensor: taken back when the runtime next reads the shards (adopt_edits)
        owner.take_rows(args[0], args[1])
        return None
    values = owner.values(args[0])
    return _UNANSWERED if values is None else values


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
