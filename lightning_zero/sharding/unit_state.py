"""One stage-3 unit: the parameters gathered, freed and reduced together, and its guarded state machine (sharded,
gathering, unsharded, backward). The hooks that drive units through a step are param_hooks.py's.

[Note: how a full parameter is freed and restored]
The module keeps its own ``nn.Parameter`` objects, so that user code, tied weights, the optimizer's ``param_groups``
and autograd all refer to one object per parameter. While sharded, its ``.data`` is an empty tensor (code that
touches it outside a forward sees 0 elements, never freed memory); to unshard, each of the unit's buckets (one per
dtype) is all-gathered and copied into one new tensor, and each parameter's ``.data`` becomes its view of it
(``ParamShard.to_unsharded``). Swapping ``.data`` leaves the version counter alone, so autograd accepts the parameters
it saved in forward once the pre-backward hook has gathered them again.

Autograd also saves *views* of the full parameters, not the parameters: ``nn.Linear`` on an input that needs a
gradient saves ``weight.t()`` for its backward. Such a view refers to the storage the parameter had in the forward,
so swapping ``.data`` alone would keep every unit's gathered storage alive from its forward to its backward (all
gathered parameters at once at the end of the forward, as with ``reshard_after_forward=False``), and the backward's
gather would go into a second copy. So each gather bucket keeps one storage for the life of the unit: a gather fills
it and the parameters become views of it, a reshard resizes it to 0 bytes in place (as FSDP2 does), which frees the
memory for the saved views too, and the next gather gives it its size back before filling it, so that the saved
views read the newly gathered values. A saved view is only read in the unit's backward, after its pre-backward hook
gathered the unit. A view of a full parameter kept past a reshard by user code has no memory behind it then: it must
not be read (CUDA reports an illegal memory access; on a host it may crash); keep a ``.clone()`` instead. A storage
that a NumPy array shares (``.numpy()`` of a full parameter makes it non-resizable) is left to the array, and the
next gather fills a new one.

[Note: hpZ's secondary shards]
ZeRO++'s hpZ (``hpz_group_size=K2``): the backward all-gather of a unit is the same tensor its forward gathered, so
instead of gathering it again over the shard group (whose ranks span nodes), each rank keeps a slice of it. When a
unit's forward ends (``keep_secondary``, before the reshard; only in training, where its outputs need a gradient),
each gather bucket's storage, ``F = N * S`` elements (parameter-major, with the padding: [Note: how a parameter is
split] in flat_param.py), is viewed as ``(K2, F / K2)`` and the rank at position ``j`` of its hpZ group (``K2``
consecutive ranks, normally one node, inside the shard group: ``K2`` divides ``N``) keeps row ``j``, a copy:
``F * b / K2`` bytes per bucket, ``b`` the working dtype's bytes. The unit's backward gather (the pre-backward
hook's, its prefetches, and activation checkpointing's recomputation, which reuses it) gives the storage its size
back, writes row ``j`` into it and all-gathers the rows inside the hpZ group in place (``Collectives.all_gather_rows``):
nothing to unpack, and nothing of it crosses nodes. Once that gather completes the secondary is freed. The values are
the forward's bit for bit: flat zero3's backward gathers the same rows of the unchanged shards again, so training is
bitwise flat zero3's; under qwZ the secondary holds the dequantized values the forward computed with, as
``reshard_after_forward=False`` keeps them. A secondary nothing used (a unit whose outputs got no gradient) is freed
after the backward (``post_backward``), at the end of the step, when the shards are updated or gathered for
``gathered``. The root unit, gathered for the whole step, keeps none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from enum import Enum, auto
from functools import partial

from torch import Tensor, nn

from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.in_flight import BucketGather, BufferPool, gather_bucket
from lightning_zero.sharding.buckets import make_buckets
from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.quantize import BlockFormat

#: A bucket size with no cap: a unit moves its parameters of one dtype in one collective.
UNBOUNDED = 1 << 62


class UnitState(Enum):
    SHARDED = auto()
    """Only the local shards exist; the full parameters have 0-byte storage."""
    GATHERING = auto()
    """An all-gather of the shards is in flight (a prefetch); the full parameters are not usable yet."""
    UNSHARDED = auto()
    """The full parameters hold the current values (forward, evaluation, ``gathered_parameters``)."""
    BACKWARD = auto()
    """Gathered for backward; ``Unit.outstanding`` lists what must happen before its gradients can be reduced."""


class RankDivergenceError(RuntimeError):
    """Ranks issued different unit collectives: control flow differed between ranks under zero3."""


class Unit:
    """The parameters of one module that are gathered, freed and reduced together.

    ``announce(kind, unit)`` is called before each of the unit's collectives (see ``ShardedParams._announce``); what
    it returns, if not ``None``, is called before the collective is waited on.
    """

    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module,
        shards: Sequence[ParamShard],
        comms: Collectives,
        announce: Callable[[str, Unit], Callable[[], None] | None] = lambda kind, unit: None,
    ):
        self.index = index
        self.name = name or "<root>"
        self.module = module
        self.shards = list(shards)
        self.comms = comms
        self.announce = announce
        #: Context around packing the shards for a gather, giving the tensors to pack (``None``: each shard's
        #: ``gather_source``); offload reads parameter shards kept on disk into a buffer there.
        self.staged = _nothing
        #: Where the rank-major gather buffers come from and go back to once unpacked (``ShardedParams`` shares one
        #: across its units; this one keeps none, so each gather allocates afresh).
        self.pool = BufferPool(comms.device, limit=0)
        self.gather_buckets = make_buckets(self.shards, UNBOUNDED)
        #: The format of the quantized gathers ``start_unshard(quantized=True)`` asks for (qwZ; ``None``: off).
        self.weight_format: BlockFormat | None = None
        #: Whether the parameters gathered (or on their way) were gathered quantized.
        self.quantized = False
        #: Per gather bucket, the storage the full parameters are views of: kept from gather to gather and emptied
        #: in place between them (see [Note: how a full parameter is freed and restored]).
        self._storages: list[Tensor | None] = [None] * len(self.gather_buckets)
        self.state = UnitState.SHARDED
        #: In state BACKWARD: the shards whose gradient has not been accumulated yet, and "inputs" once per forward
        #: call whose inputs' gradients do not exist yet.
        self.outstanding: Counter = Counter()
        self._gathers: list[BucketGather] = []
        #: hpZ: the collectives over this rank's hpZ group (``None``: off), and per gather bucket this rank's row of
        #: the storage kept from the forward, with whether it was gathered quantized (see [Note: hpZ's secondary
        #: shards]); ``_from_secondary``: the gather in flight is the one from them.
        self.hpz: Collectives | None = None
        self._secondary: list[Tensor] | None = None
        self._secondary_quantized = False
        self._from_secondary = False

    def __repr__(self) -> str:
        return f"unit {self.name!r}"

    def _expect(self, *states: UnitState) -> None:
        if self.state not in states:
            names = " or ".join(s.name for s in states)
            raise AssertionError(f"{self}: expected state {names}, found {self.state.name}")

    def start_unshard(self, quantized: bool = False, backward: bool = False) -> None:
        """Issue the all-gather of this unit's shards, unless it is already gathered or on its way; ``quantized``:
        in ``weight_format``, if set (a step's gathers under qwZ); ``backward``: from the secondary shards,
        if the forward kept them (hpZ, which then serves the gather whatever ``quantized`` says)."""
        if self.state is not UnitState.SHARDED:
            return
        guard = self.announce("gather", self) if self.gather_buckets else None
        if backward and self._secondary is not None:
            self._gather_secondary(guard)
            return
        fmt = self.weight_format if quantized else None
        with self.staged(self.shards) as sources:
            source_of = dict(zip(self.shards, sources)) if sources is not None else None
            self._gathers = [
                gather_bucket(self.comms, self.pool, bucket,
                              [source_of[s] for s in bucket.shards] if source_of is not None else None, guard=guard,
                              fmt=fmt)
                for bucket in self.gather_buckets
            ]
        self.quantized = fmt is not None
        self.state = UnitState.GATHERING

    def wait_unshard(self, quantized: bool = False, backward: bool = False) -> None:
        """Make the full parameters usable, gathering now if no prefetch did (``quantized``, ``backward``: see
        ``start_unshard``; a gather already issued keeps its own)."""
        self.start_unshard(quantized, backward)
        if self.state is not UnitState.GATHERING:
            return
        for i, (bucket, gather) in enumerate(zip(self.gather_buckets, self._gathers)):
            if self._from_secondary:  # gathered in place into the storage: parameter-major already
                pieces = bucket.storage_pieces(gather.complete(lambda table: table.view(-1)))
            else:
                pieces = gather.complete(partial(bucket.unpack_to_storage, storage=self._sized_storage(i)))
            for shard, piece in zip(bucket.shards, pieces):
                shard.to_unsharded(piece)
                shard.mark_written(exact=not self.quantized)
        self._gathers = []
        if self._from_secondary:
            self._from_secondary = False
            self.drop_secondary()  # served its one backward gather
        self.state = UnitState.UNSHARDED

    def _sized_storage(self, i: int) -> Tensor:
        """Gather bucket ``i``'s storage with its full size again (a new one if a NumPy array kept the last)."""
        storage = self._storages[i]
        if storage is None:
            storage = self._storages[i] = self.gather_buckets[i].empty()
        else:
            storage.untyped_storage().resize_(storage.nbytes)
        return storage

    # ------------------------------------------------------------------------------------------------------ hpZ

    def keep_secondary(self) -> None:
        """At the end of the unit's forward (gathered): keep this rank's row of each bucket's storage for the
        backward gather (see [Note: hpZ's secondary shards])."""
        if self.hpz is None:
            return
        self._expect(UnitState.UNSHARDED)
        k, j = self.hpz.world_size, self.hpz.rank
        self._secondary = [storage.view(k, -1)[j].clone() for storage in self._storages]
        self._secondary_quantized = self.quantized

    def drop_secondary(self) -> None:
        self._secondary = None

    def secondary_shards(self) -> list[Tensor]:
        """The secondary shards held now (for ``model_state_bytes``)."""
        return list(self._secondary or [])

    def _gather_secondary(self, guard: Callable[[], None] | None) -> None:
        """Issue the backward gather from the secondary shards, in place in each bucket's storage, inside the hpZ
        group."""
        hpz = self.hpz
        self._gathers = []
        for i, (bucket, row) in enumerate(zip(self.gather_buckets, self._secondary)):
            table = self._sized_storage(i).view(hpz.world_size, -1)
            table[hpz.rank].copy_(row)
            gathered = hpz.all_gather_rows(table, f"the secondary shard of {bucket.shards[0].name}", guard=guard)
            self._gathers.append(BucketGather(gathered, self.pool, None))
        self.quantized = self._secondary_quantized
        self._from_secondary = True
        self.state = UnitState.GATHERING

    def reshard(self, keep_edits: bool = True, compare: bool = False) -> None:
        """Free the full parameters (a gather in flight is completed first, to keep ranks' collectives aligned).
        ``keep_edits``: values changed in place while gathered (``load_state_dict``, in-place edits autograd counts)
        are written back into the shards first; ``compare``: also writes through ``.data``, found by comparing the
        values (a pass over the unit's rows: for the end of ``gathered_parameters``, not for every forward)."""
        if self.state is UnitState.SHARDED:
            return
        self.wait_unshard()
        for shard in self.shards:
            if keep_edits:
                shard.adopt_edits(compare)
            shard.to_sharded()
        for i, storage in enumerate(self._storages):
            if storage is None:
                continue
            if storage.untyped_storage().resizable():
                storage.untyped_storage().resize_(0)  # freed, also for the views autograd saved in the forward
            else:  # a NumPy array was made from it (.numpy()) and shares its memory: leave it to them
                self._storages[i] = None
        self.quantized = False
        self.state = UnitState.SHARDED

    def refresh(self) -> None:
        """Gather again if gathered (quantized as before): the shards were just updated, the full parameters are
        stale."""
        if self.state is not UnitState.SHARDED:
            quantized = self.quantized
            self.reshard(keep_edits=False)
            self.wait_unshard(quantized)

    def enter_backward(self, input_grad_calls: int) -> None:
        """Gathered for backward; done once ``outstanding`` empties (``input_grad_calls``: forward calls of this
        step whose inputs need a gradient)."""
        if self.state is UnitState.BACKWARD:
            return
        self.wait_unshard(quantized=True, backward=True)
        self._expect(UnitState.UNSHARDED)
        self.outstanding = Counter(s for s in self.shards if s.trainable)
        if input_grad_calls:
            self.outstanding["inputs"] = input_grad_calls
        self.state = UnitState.BACKWARD

    def mark(self, event: object) -> bool:
        """Record a backward event (a shard's gradient accumulated, or "inputs"); whether the unit is now done."""
        if self.state is not UnitState.BACKWARD or event not in self.outstanding:
            return False
        self.outstanding[event] -= 1
        if self.outstanding[event] <= 0:
            del self.outstanding[event]
        return not self.outstanding


@contextmanager
def _nothing(*_args: object) -> Iterator[None]:
    yield None
