"""Bookkeeping of who owns which elements: per-parameter dim-0 shards and the sharded/unsharded transitions of a
parameter (the buckets that move them: buckets.py).

Nothing in this module calls ``torch.distributed``; it is plain tensor arithmetic and is unit-tested without processes.

[Note: how a parameter is split]
Every parameter is split on dim 0 into ``world_size`` chunks of ``ceil(rows / world_size)`` rows each (a 0-d
parameter counts as one row). Rank ``r`` owns rows ``[r * c, min((r + 1) * c, rows))``, which may be empty for the
last ranks when a parameter has fewer rows than there are ranks. Owned rows are contiguous in the parameter's storage,
so the local shard of a contiguous full parameter is a view, not a copy.

For a collective, the parameters of a ``Bucket`` (one dtype, one device) are packed into one flat buffer laid out
rank-major: ``N`` segments of ``S`` elements, where segment ``r`` is the concatenation of each parameter's chunk ``r``
padded to ``c * row_numel`` elements. A reduce-scatter of that buffer leaves rank ``r`` with exactly its segment, and
an all-gather of the segments rebuilds the buffer. Padding is at most ``N - 1`` rows per parameter and is always zero.
Packing is one fused ``torch._chunk_cat`` and unpacking one ``torch.split_with_sizes_copy``, not a loop of copies.

[Note: the reduced gradient lives in param.grad]
Once a parameter's gradient is reduced, ``param.grad`` holds this rank's shard of the averaged gradient: its owned
rows, in the reduction dtype, wrapped as a ``ShardedGrad`` of the full shape that answers user code as the full
gradient would (sharded_grad.py; FSDP2's parameters hold local gradient shards as DTensors the same way). Keeping it
there is what makes the optimizer's ``zero_grad`` (which walks its ``param_groups``, the module's parameters) clear
it, or zero it in place, with no hook on the optimizer: the next backward's reduction then starts from nothing, or
accumulates onto the zeros, exactly as ``zero_grad`` means for DDP's full gradients. Before each backward the
runtime takes such shards out of ``param.grad`` (autograd must find it empty or full-shaped) and adds the new
reduction to them; the step takes whatever user code left there (``ParamShard.grad_rows``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_zero.sharding.sharded_grad import ShardedGrad
from lightning_zero.sharding.sharded_param import placeholder, plain_data, sharded_class


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter of ``shape`` is split on dim 0 across ``world_size`` ranks, seen from ``rank``."""

    shape: torch.Size
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is outside [0, world_size={self.world_size})")

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) > 0 else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 0 else 1

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def rows_per_rank(self) -> int:
        return -(-self.rows // self.world_size)

    @property
    def padded_numel(self) -> int:
        """Elements of one rank's chunk including padding: the size it takes in a flat segment."""
        return self.rows_per_rank * self.row_numel

    def owned_rows(self, rank: int | None = None) -> tuple[int, int]:
        """Half-open row range owned by ``rank`` (default: this spec's rank), clipped to the real rows."""
        r = self.rank if rank is None else rank
        lo = min(r * self.rows_per_rank, self.rows)
        hi = min(lo + self.rows_per_rank, self.rows)
        return lo, hi

    @property
    def local_rows(self) -> int:
        lo, hi = self.owned_rows()
        return hi - lo

    @property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel

    @property
    def local_shape(self) -> torch.Size:
        """Shape of the unpadded local shard (a 0-d parameter's shard is 1-d with 0 or 1 element)."""
        return torch.Size((self.local_rows, *self.shape[1:]))

    def local_view(self, full: Tensor) -> Tensor:
        """The owned rows of a full tensor of this spec's shape, as a view of it (whatever its strides)."""
        lo, hi = self.owned_rows()
        return (full if full.dim() > 0 else full.reshape(1)).narrow(0, lo, hi - lo)

    def other_rows(self, full: Tensor) -> tuple[Tensor, Tensor]:
        """Views of the rows of ``full`` before and after the owned ones."""
        lo, hi = self.owned_rows()
        rows = full if full.dim() > 0 else full.reshape(1)
        return rows.narrow(0, 0, lo), rows.narrow(0, hi, self.rows - hi)


@dataclass(eq=False)
class ParamShard:
    """One model parameter and this rank's shard of it.

    ``param`` is the module's own ``nn.Parameter``: the optimizer's ``param_groups`` and user code keep referring to
    it. ``local`` holds the owned rows the optimizer updates: in full precision with stages 1 and 2 a view of
    ``param``'s rows (a step updates the full parameter in place); with stage 3 or 16-bit working parameters a
    standalone tensor (the fp32 master in mixed precision). ``dtype`` is the full parameter's (working) dtype.

    Stage 3 keeps the parameter sharded between uses (``to_sharded``): it keeps its full shape, dtype and device but
    holds no values, and reading them raises (see [Note: a sharded parameter keeps its shape] in sharded_param.py);
    for a forward or backward its ``.data`` is a view of gathered storage (``to_unsharded``).
    """

    name: str
    param: nn.Parameter
    spec: ShardSpec
    local: Tensor
    #: The full parameter's (working) dtype and device: where a gather puts it.
    dtype: torch.dtype
    device: torch.device
    #: With offloaded masters: this rank's rows in ``dtype`` where the gathers read them (the device; the host with
    #: ``offload_params``). ``None``: the gathers read ``local``.
    working: Tensor | None = None
    #: Whether ``param`` holds only its shard now (stage 3 between uses).
    sharded: bool = False
    #: Whether the end of fit gave the module its full parameters back (``ZeroRuntime.release``): the parameter is
    #: the user's again, and edits are only copied into the shards (a checkpoint saved after fit reads them).
    released: bool = False
    #: ``param._version`` and ``param.data_ptr()`` when the runtime last wrote the parameter (see ``adopt_edits``).
    written_version: int = -1
    written_ptr: int = -1
    written_storage: int = -1
    written_exact: bool = True
    #: A stage-3 parameter: whole only while its unit is gathered (``to_sharded`` was called once).
    by_unit: bool = False
    #: The master lives in a file (disk offload): what is put into it is copied there, never aliased.
    master_in_file: bool = False

    def __post_init__(self) -> None:
        #: The parameter's own class, which it has whenever it holds values.
        self.param_class: type = type(self.param)

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad

    @property
    def gather_source(self) -> Tensor:
        """The rows this rank contributes to an all-gather of the parameter."""
        return self.local if self.working is None else self.working

    def to_sharded(self) -> None:
        """Drop the full parameter: it keeps its shape and no values (see [Note: a sharded parameter keeps its
        shape])."""
        self.param.data = placeholder(self.spec.shape, self.dtype, self.device)
        self.param.__class__ = sharded_class(self.param_class)
        self.sharded = self.by_unit = True
        self.mark_written()

    def to_unsharded(self, storage: Tensor) -> None:
        """Make the full parameter a view of ``storage`` (at least ``spec.numel`` elements of ``dtype``)."""
        self.hold(storage[: self.spec.numel].view(self.spec.shape))

    def hold(self, values: Tensor) -> None:
        """Give the parameter ``values`` (of its full shape): it is whole again, of its own class."""
        self.param.__class__ = self.param_class
        self.param.data = values
        self.sharded = False

    def mark_written(self, exact: bool = True) -> None:
        """The full parameter now holds what the shards say (after a gather or an adopted edit); ``exact=False``: an
        approximation of it (a quantized gather, qwZ), whose values cannot tell an edit."""
        with torch._C.DisableTorchFunctionSubclass():  # metadata of a sharded parameter, without its checks
            self.written_version = self.param._version
            self.written_ptr = self.param.data_ptr()
            self.written_storage = self.param.untyped_storage().data_ptr()
        self.written_exact = exact

    @torch.no_grad()
    def adopt_edits(self, compare: bool = True) -> None:
        """Take what user code wrote into the parameter since the runtime last wrote it into the shards (see [Note:
        what user code sees of a parameter and its gradient] in user_view.py): a rebinding of ``.data``, an edit
        autograd's version counter sees, and, with ``compare``, any change of the values (a write through ``.data``
        moves no version counter), element by element and without a host synchronisation."""
        full = plain_data(self.param)
        if full.data_ptr() != self.written_ptr and not self.released:
            self._follow_rebinding(full)
            return
        compare = compare and self.written_exact
        if self.sharded or (not compare and self.param._version == self.written_version):
            return
        rows = self.spec.local_view(self.param.detach())
        for destination in (self.local, self.working):
            if destination is not None and not _same_memory(destination, rows):
                _adopt_changed_elements(destination, rows)
        self.mark_written()

    def _follow_rebinding(self, full: Tensor) -> None:
        """``param.data = other``: the shards take all of ``other``'s rows, and the parameter keeps aliasing
        ``other``, as under DDP (``ModelPruning``'s lottery-ticket reset relies on it): shards that were views of the
        old parameter become views of the new one, and a floating-point tensor of another dtype becomes the
        parameter's working dtype (an fp32 tensor put into a bf16 parameter under mixed precision: DDP's parameters
        are fp32 there). A stage-3 parameter holds its values only while its unit is gathered: its rows are taken
        (``take_rows``), it keeps its working dtype, and a sharded one is emptied again."""
        if full.shape != self.spec.shape:
            raise ValueError(
                f"parameter {self.name!r} was rebound to a tensor of shape {tuple(full.shape)} (`.data = ...`), its "
                f"shape is {tuple(self.spec.shape)}: ZeRO keeps each parameter's shape for its whole life; build the "
                "model with the final shapes"
            )
        if self.by_unit:
            self.take_rows(self.spec.local_view(full))
            if self.sharded:
                self.to_sharded()
            self.mark_written()
            return
        follows_dtype = full.dtype.is_floating_point and self.dtype.is_floating_point
        if full.device != self.device or (full.dtype != self.dtype and not follows_dtype):
            full = full.to(self.device, self.dtype)
            self.param.data = full
        self.dtype = full.dtype
        old = [d is not None and d.untyped_storage().data_ptr() == self.written_storage for d in (self.local, self.working)]
        rows = self.spec.local_view(full)
        if old[0]:
            self.local = rows
        elif self.local is not None:
            self.local.copy_(rows)
        if old[1]:
            self.working = rows
        elif self.working is not None:
            self.working.copy_(rows)
        self.mark_written()

    @torch.no_grad()
    def take_rows(self, rows: Tensor) -> None:
        """A stage-3 parameter's rows become ``rows`` (of ``spec.local_shape``: a rebinding's, see
        ``_follow_rebinding``, or a ``ShardedValues``' assigned to ``.data``). The master aliases them where it can
        (same dtype and device, contiguous, not in a file), as DDP's parameter aliases the tensor it was rebound to
        (a second lottery-ticket reset from the same copy then changes nothing, as under DDP); else they are copied
        in (cast to the master's dtype). An offload's working rows take them too."""
        rows = rows.reshape(self.spec.local_shape) if rows.shape != self.spec.local_shape else rows
        aliasable = rows.dtype == self.local.dtype and rows.device == self.local.device and rows.is_contiguous()
        if aliasable and not self.master_in_file:
            self.local = rows
        else:
            self.local.copy_(rows)
        if self.working is not None:
            self.working.copy_(rows)

    def grad_rows(self) -> Tensor | None:
        """This rank's rows of the gradient the step uses, shaped ``spec.local_shape``: what ``param.grad`` holds
        when the step takes it back (see [Note: what user code sees of a parameter and its gradient] in
        user_view.py): a ``ShardedGrad``'s rows, the rows of a full-shape gradient (user code assigned one, or
        world size 1, where autograd's own gradient is the shard), or ``None``."""
        grad = self.param.grad
        if grad is None:
            return None
        if isinstance(grad, ShardedGrad):
            layout = grad._layout
            if layout.shape != self.spec.shape or (layout.lo, layout.hi) != self.spec.owned_rows():
                raise ValueError(f"the gradient of {self.name!r} holds rows {layout.lo}-{layout.hi} of shape "
                                 f"{tuple(layout.shape)}; this rank steps rows {self.spec.owned_rows()}")
            return grad._local.view(self.spec.local_shape)
        if grad.shape == self.spec.shape:
            return self.spec.local_view(grad)
        if grad.shape == self.spec.local_shape:  # a shard put there by the runtime itself
            return grad
        raise ValueError(f"the gradient of {self.name!r} has shape {tuple(grad.shape)}, the parameter "
                         f"{tuple(self.spec.shape)}")

    def set_grad_shard(self, grad: Tensor | None) -> None:
        """Put a reduced gradient shard (or None) in ``param.grad``, whatever the parameter's current shape."""
        if grad is None or (grad.shape == self.param.shape and grad.dtype == self.param.dtype):
            self.param.grad = grad
            return
        data = plain_data(self.param)
        self.param.data = placeholder(grad.shape, grad.dtype, grad.device)
        try:
            self.param.grad = grad
        finally:
            self.param.data = data


def _same_memory(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.device == b.device


#: Elements compared at once by ``_adopt_changed_elements`` (its transients: 3 bytes an element).
_ADOPT_PIECE = 1 << 24


def _adopt_changed_elements(destination: Tensor, rows: Tensor) -> None:
    """Where ``rows`` (what the parameter holds) differs from ``destination`` as the runtime last wrote it (cast to
    the parameter's dtype), ``destination`` takes the new value; the other elements keep theirs (an fp32 master keeps
    its precision where a 16-bit parameter was not touched). Rows on another device (an offloaded master on the host,
    when the parameter is on a GPU) are copied over first."""
    rows = rows.to(destination.device)
    pairs = [(destination, rows)]
    if destination.is_contiguous() and rows.is_contiguous():  # pieces: the transients stay small
        pairs = zip(destination.view(-1).split(_ADOPT_PIECE), rows.view(-1).split(_ADOPT_PIECE))
    narrower = torch.promote_types(rows.dtype, destination.dtype) != destination.dtype
    for kept, now in pairs:
        # Two passes (the cast and compare, the select written in place): the check runs on every parameter of a
        # mixed-precision step, and a select into a new tensor copied back cost twice the memory traffic.
        torch.where(now == kept.to(now.dtype), kept, now.to(kept.dtype) if narrower else now, out=kept)


def clean_name(name: str) -> str:
    """A parameter's name as the model's state_dict spells it (activation checkpointing's wrapper adds a level)."""
    return name.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")


def shard_parameters(
    named_params: Iterable[tuple[str, nn.Parameter]],
    rank: int,
    world_size: int,
    master_dtype: torch.dtype | None = None,
) -> list[ParamShard]:
    """A :class:`ParamShard` per parameter, its local rows a view of the full parameter, or a copy in
    ``master_dtype`` (for fp32 masters of 16-bit parameters, or the standalone shards of stage 3)."""
    shards = []
    for name, param in named_params:
        spec = ShardSpec(param.shape, rank, world_size)
        rows = spec.local_view(param.detach())
        if master_dtype is not None:
            rows = rows.to(master_dtype, copy=True)
        shards.append(ParamShard(clean_name(name), param, spec, rows, param.dtype, param.device))
    return shards
