"""Copies of stage-3 parameters that user code makes between their uses: this rank's rows, whole where they are used.

[Note: a user's copy of a sharded module]
Code written for DDP copies the module it trains: ``torch.optim.swa_utils.AveragedModel(self)`` built in
``on_fit_start`` and updated after every batch (the EMA written by hand, as timm's and many papers' code do),
``copy.deepcopy(model)`` for a teacher or a best-so-far snapshot. Under stage 3 such a copy is made between the
parameters' uses, so each deep-copied parameter (``_Sharded.__deepcopy__`` asks its ``UserCopies``) becomes a
``CopiedValues``: a copy of this rank's rows of its values (4Ψ/N bytes per rank for an fp32 copy, not 4Ψ), in their
dtype (the fp32 master's under mixed precision, as DDP's parameter is fp32), where they live (the host, offloaded).
Between uses it answers as ``ShardedValues`` do ([Note: a parameter's values between its uses] in sharded_param.py),
so ``update_parameters`` (``_foreach_lerp_``, ``copy_``, ``avg_fn``'s arithmetic, buffers with ``use_buffers``)
averages each rank's rows with DDP's arithmetic and no communication.

What needs the other ranks' rows (a forward of the copy, ``parameters_to_vector``, ``torch.save`` of its
``state_dict()``) needs the copy whole. ``trainer.strategy.gathered_parameters()``, which makes the module whole, makes
every live copy whole too (``UserCopies.whole``): one all-gather of their rows, in the order the copies were made;
inside, each copy answers every operation as its full tensor (a plain tensor comes out), and what is written into it
is kept in its rows on exit. At the end of fit the copies are made whole for good, as the module is (``release``), so
``ema.module`` after ``trainer.fit`` holds DDP's values. Outside both, an operation that needs other rows is refused,
naming that scope.

The collectives' order must be the same on every rank (issue 52), and copies are found through weak references,
whose lifetime the garbage collector decides: before gathering, the ranks exchange how many copies they hold and of
how many elements (one small exchange on the control channel); where they differ, after one ``gc.collect()``, every
rank raises the same error instead of gathering (a copy made on one rank only, ``if rank == 0: deepcopy(model)``, can
never be made whole). Copies made before the module was sharded (Lightning's ``WeightAveraging`` and
``StochasticWeightAveraging``) are cut to rows by ``UserView.shard_copy`` and stay rows (sharded_callbacks.py).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_zero.sharding.buckets import make_buckets
from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.in_flight import BufferPool, gather_bucket
from lightning_zero.sharding.sharded_grad import RowLayout
from lightning_zero.sharding.sharded_param import ShardedParameterError, ShardedValues, copy_with


class CopiedValues(ShardedValues):
    """This rank's rows of a copy of a stage-3 parameter user code made between its uses, or, while its copy is
    whole, the full tensor (see [Note: a user's copy of a sharded module])."""

    _owner: _Copy

    def _whole(self) -> Tensor | None:
        """The full tensor while the copy is whole and this tensor is the copy (or an alias of it), else ``None``."""
        return self._owner.whole_of(self)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(isinstance(a, CopiedValues) and a._whole() is not None for a in tree_flatten((args, kwargs))[0]):
            return super().__torch_dispatch__(func, types, args, kwargs)
        unwrapped = tree_map(lambda a: a._whole() if isinstance(a, CopiedValues) and a._whole() is not None else a,
                             (args, kwargs))
        return func(*unwrapped[0], **unwrapped[1])

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        whole = self._whole()
        return repr(whole) if whole is not None else (
            f"CopiedValues(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, {self._where()}: "
            f"this rank's rows of a copy of the zero3 parameter {self._name})")

    def refusal(self, what: str) -> Exception:
        return ShardedParameterError(
            f"{what} on a copy of zero3 parameter {self._name!r} (made by deepcopy between its uses: torch's "
            "AveragedModel, an EMA or a snapshot of the module) outside a gathered scope: each rank holds only its "
            "rows of the copy, and this operation would need the other ranks' rows. Element-wise arithmetic, copies "
            "and reductions work on it as on the full tensor (update_parameters does); to use the copy whole (its "
            "forward, parameters_to_vector, torch.save of its state_dict) use `with "
            "trainer.strategy.gathered_parameters():`, which makes such copies whole too (every rank must enter it; "
            "edits made inside are kept), or read it after fit, where it is whole"
        )

    def data_ptr(self) -> int:
        whole = self._whole()
        return whole.data_ptr() if whole is not None else super().data_ptr()

    def untyped_storage(self):
        whole = self._whole()
        return whole.untyped_storage() if whole is not None else super().untyped_storage()

    def tolist(self):
        whole = self._whole()
        return whole.tolist() if whole is not None else super().tolist()

    def numpy(self, *, force: bool = False):
        whole = self._whole()
        return whole.numpy(force=force) if whole is not None else super().numpy(force=force)

    def __array__(self, *args, **kwargs):
        whole = self._whole()
        return whole.__array__(*args, **kwargs) if whole is not None else super().__array__(*args, **kwargs)

    def __reduce_ex__(self, protocol):  # torch.save of a whole copy writes its full tensor
        whole = self._whole()
        if whole is None:
            return super().__reduce_ex__(protocol)
        plain = whole.detach()
        return (nn.Parameter(plain, self.requires_grad) if getattr(self, "_is_param", False) else plain
                ).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):  # a copy of the copy: whole as a plain tensor, rows as another copy
        whole = self._whole()
        if whole is not None:
            copied = whole.detach().clone()
            copied = nn.Parameter(copied, self.requires_grad) if getattr(self, "_is_param", False) else copied
        else:
            copied = self._owner.copies.copy_rows(self._owner.shard, self._local, self._layout, self._name,
                                                  self.requires_grad, getattr(self, "_is_param", False))
        memo[id(self)] = copied
        return copied


class _Copy:
    """One copied parameter: its rows, the shard whose layout they follow, and its full tensor while whole; the
    owner (``Reducer``) of every ``CopiedValues`` made from it."""

    def __init__(self, copies: UserCopies, shard: ParamShard, rows: Tensor, layout: RowLayout) -> None:
        self.copies = copies
        self.shard = shard
        self.rows = rows
        self.layout = layout
        self.whole: Tensor | None = None

    def whole_of(self, values: CopiedValues) -> Tensor | None:
        """The full tensor if ``values`` holds exactly the copy's rows (the copy or an alias of it), while whole."""
        if self.whole is None or values._layout != self.layout or values._local.data_ptr() != self.rows.data_ptr():
            return None
        return self.whole

    def all_reduce(self, tensor: Tensor, op: str) -> Tensor:
        comms = self.copies.comms
        work = tensor.to(comms.device)
        comms.all_reduce_(work, "a reduction of a copy of a sharded parameter", op=op)
        return work.to(tensor.device)

    def changed(self, key: int | None = None, factor: Any = None) -> None:
        pass  # a copy's rows are its own: nothing else reads them

    def whole_norms(self, ord: float) -> dict[int, Tensor]:
        return {}


class UserCopies:
    """The copies user code made of ``shards``' stage-3 parameters between their uses, in the order they were made,
    over the shard group ``comms`` (see [Note: a user's copy of a sharded module])."""

    def __init__(self, comms: Collectives, shards: Sequence[ParamShard]) -> None:
        self.comms = comms
        self._shards = list(shards)
        self._shard_of = {shard.param: shard for shard in shards}
        #: Every copied parameter, weakly, in the order made (the same on every rank that made the same copies).
        self._made: list[weakref.ref[_Copy]] = []
        self._whole = False
        for shard in shards:
            copy_with(shard.param, self)

    def copy(self, param: nn.Parameter) -> Tensor | None:
        """``copy.deepcopy(param)`` between its uses: a new ``CopiedValues`` parameter holding a copy of its rows,
        or ``None`` where its values are not rows (the module answers for them no more)."""
        values = param.detach()
        shard = self._shard_of.get(param)
        if shard is None or not isinstance(values, ShardedValues):
            return None
        return self.copy_rows(shard, values._local, values._layout, values._name, param.requires_grad, True)

    def copy_rows(self, shard: ParamShard, rows: Tensor, layout: RowLayout, name: str, requires_grad: bool,
                  as_param: bool) -> Tensor:
        """A new copy of ``rows`` (``layout``'s, of ``shard``'s parameter), as a parameter if ``as_param``."""
        made = _Copy(self, shard, rows.clone(), layout)
        self._made.append(weakref.ref(made))
        values = CopiedValues(made.rows, layout, made, name)
        return nn.Parameter(values, requires_grad) if as_param else values

    def _stage3(self) -> bool:
        """Whether the parameters are sharded between uses, so that copies may exist (on any rank)."""
        return any(shard.by_unit for shard in self._shards)

    def _live(self) -> list[_Copy]:
        live = [c for c in (ref() for ref in self._made) if c is not None]
        self._made = [weakref.ref(c) for c in live]
        return live

    def _agreed(self) -> list[_Copy]:
        """The live copies, once every rank holds as many, of as many elements (see the Note)."""
        for attempt in range(2):
            live = self._live()
            mine = [len(live), sum(c.shard.spec.numel for c in live)]
            everyone = self.comms.exchange(mine)
            if all(list(v) == mine for v in everyone):
                return live
            if attempt == 0:
                gc.collect()  # a copy dropped on every rank may wait in a reference cycle on one
        counts = ", ".join(f"rank {r}: {n} copies of {e} elements" for r, (n, e) in enumerate(everyone))
        raise ShardedParameterError(
            f"the ranks hold different copies of zero3 parameters ({counts}), so none can be made whole: copies made "
            "between their uses (deepcopy, torch's AveragedModel) must be made on every rank, in the same order")

    @contextmanager
    def whole(self, device: torch.device | None = None) -> Iterator[None]:
        """Every live copy whole while inside (its full tensor on its parameter's device, or ``device``); what is
        written into it is kept in its rows on exit. Every rank must enter it."""
        if self._whole or not self._stage3():
            yield
            return
        copies = self._agreed()
        self._gather(copies, device)
        self._whole = True
        try:
            yield
        finally:
            self._whole = False
            with torch.no_grad():
                for made in copies:
                    made.rows.copy_(made.shard.spec.local_view(made.whole).reshape(made.rows.shape))
                    made.whole = None

    def release(self, device: torch.device) -> None:
        """End of fit: every live copy whole for good, on ``device``, as the module is."""
        if not self._stage3():
            return
        copies = self._agreed()
        self._gather(copies, device)
        self._whole = True

    @torch.no_grad()
    def _gather(self, copies: list[_Copy], device: torch.device | None) -> None:
        """Each copy's full tensor, all-gathered bucket by bucket, copies of one dtype together in the order made."""
        pool = BufferPool(self.comms.device, limit=0)
        for dtype in dict.fromkeys(c.rows.dtype for c in copies):
            group = [c for c in copies if c.rows.dtype == dtype and c.shard.spec.numel > 0]
            for bucket, members in _bucketed(group, dtype):
                targets = [torch.empty(c.shard.spec.shape, dtype=dtype, device=c.shard.device) for c in members]
                sources = [c.rows.reshape(c.shard.spec.local_shape) for c in members]
                gather_bucket(self.comms, pool, bucket, sources).complete(partial(bucket.unpack, tensors=targets))
                for made, full in zip(members, targets):
                    made.whole = full if device is None else full.to(device)
        for made in copies:
            if made.shard.spec.numel == 0:
                made.whole = torch.empty(made.shard.spec.shape, dtype=made.rows.dtype, device=device or made.shard.device)


def _bucketed(copies: list[_Copy], dtype: torch.dtype) -> Iterator[tuple[Any, list[_Copy]]]:
    """The buckets of ``copies``' shards (``make_buckets`` keeps their order; a shard may appear more than once),
    each with the copies it gathers."""
    position = 0
    for bucket in make_buckets([c.shard for c in copies], 1 << 62, dtype):
        yield bucket, copies[position : position + len(bucket)]
        position += len(bucket)
