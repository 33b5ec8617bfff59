"""Bookkeeping of who owns which elements: per-parameter dim-0 shards and the flat buffers used to move them.

Nothing in this module calls ``torch.distributed``; it is plain tensor arithmetic and is unit-tested without processes.

[Note: how a parameter is split]
Every parameter is split on dim 0 into ``world_size`` chunks of ``ceil(rows / world_size)`` rows each (a 0-d
parameter counts as one row). Rank ``r`` owns rows ``[r * c, min((r + 1) * c, rows))``, which may be empty for the
last ranks when a parameter has fewer rows than there are ranks. Owned rows are contiguous in the parameter's storage,
so the local shard of a full parameter is a view, not a copy.

For a collective, several parameters are packed into one flat buffer laid out rank-major: ``N`` segments of ``S``
elements, where segment ``r`` is the concatenation of each parameter's chunk ``r`` padded to ``c * row_numel``
elements. A reduce-scatter of that buffer leaves rank ``r`` with exactly its segment, and an all-gather of the
segments rebuilds the buffer. Padding is at most ``N - 1`` rows per parameter and is always zero.

Alternative considered: one flat concatenation of all parameters with each rank owning a contiguous 1/N (DeepSpeed,
FSDP1). It balances perfectly and avoids the pack copies, but hands the optimizer ragged pieces of matrices, forbids
frozen and trainable parameters in one buffer, and makes state dicts and resharding need communication. Dim-0
shards keep every shard a rectangular slice of a named parameter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


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
        """The owned rows of a full tensor of this spec's shape, as a view sharing its storage."""
        lo, hi = self.owned_rows()
        return full.view(self.rows, *self.shape[1:])[lo:hi]


class FlatLayout:
    """Where each of a group of parameters sits in a rank-major flat buffer (see [Note: how a parameter is split]).

    ``segment_numel`` is the per-rank segment ``S``; a full buffer has ``world_size * S`` elements.
    """

    def __init__(self, specs: Sequence[ShardSpec]) -> None:
        if not specs:
            raise ValueError("a FlatLayout needs at least one parameter")
        world_sizes = {s.world_size for s in specs}
        if len(world_sizes) != 1:
            raise ValueError(f"all specs of a layout must share one world size, got {sorted(world_sizes)}")
        self.specs = tuple(specs)
        self.world_size = specs[0].world_size
        self.rank = specs[0].rank
        self.offsets: tuple[int, ...] = tuple(_cumulative([s.padded_numel for s in specs]))
        self.segment_numel = sum(s.padded_numel for s in specs)

    @property
    def full_numel(self) -> int:
        return self.world_size * self.segment_numel

    @property
    def unpadded_numel(self) -> int:
        return sum(s.numel for s in self.specs)

    def pack(self, tensors: Sequence[Tensor | None], out: Tensor) -> None:
        """Write full tensors (``None`` counts as zeros) into the rank-major buffer ``out``, zeroing the padding."""
        table = out.view(self.world_size, self.segment_numel)
        for spec, offset, tensor in zip(self.specs, self.offsets, tensors):
            dst = table[:, offset : offset + spec.padded_numel]
            if tensor is None:
                dst.zero_()
                continue
            src = tensor.reshape(-1)
            full, rem = divmod(spec.numel, spec.padded_numel)
            dst[:full].copy_(src[: full * spec.padded_numel].view(full, spec.padded_numel))
            if full < self.world_size:
                dst[full, :rem].copy_(src[full * spec.padded_numel :])
                dst[full, rem:].zero_()
                dst[full + 1 :].zero_()

    def unpack(self, buffer: Tensor, tensors: Sequence[Tensor]) -> None:
        """Copy a rank-major buffer back into full tensors, dropping the padding (the inverse of ``pack``)."""
        table = buffer.view(self.world_size, self.segment_numel)
        for spec, offset, tensor in zip(self.specs, self.offsets, tensors):
            src = table[:, offset : offset + spec.padded_numel]
            dst = tensor.view(-1)
            full, rem = divmod(spec.numel, spec.padded_numel)
            dst[: full * spec.padded_numel].view(full, spec.padded_numel).copy_(src[:full])
            if rem:
                dst[full * spec.padded_numel :].copy_(src[full, :rem])

    def pack_local(self, shards: Sequence[Tensor], segment: Tensor) -> None:
        """Write this rank's unpadded shards into its segment, zeroing the padding."""
        for spec, view, shard in zip(self.specs, self.segment_views(segment), shards):
            view[: spec.local_rows].copy_(shard)
            view[spec.local_rows :].zero_()

    def segment_views(self, segment: Tensor) -> list[Tensor]:
        """Per-parameter views ``(rows_per_rank, *shape[1:])`` of one rank's segment, padding included."""
        return [
            segment[offset : offset + spec.padded_numel].view(spec.rows_per_rank, *spec.shape[1:])
            for spec, offset in zip(self.specs, self.offsets)
        ]

    def local_views(self, segment: Tensor) -> list[Tensor]:
        """Per-parameter views of the unpadded shards inside one rank's segment."""
        return [view[: spec.local_rows] for spec, view in zip(self.specs, self.segment_views(segment))]


def _cumulative(sizes: Iterable[int]) -> list[int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets


@dataclass(eq=False)
class ParamShard:
    """One model parameter and this rank's shard of it.

    ``local`` is the ``nn.Parameter`` the optimizer updates. In full precision with stages 1 and 2 it is a view of the
    owned rows of ``full``, so a step on it updates the full parameter in place; with stage 3 or with 16-bit working
    parameters it is a standalone tensor (the fp32 master in mixed precision). ``grad`` holds the averaged gradient
    of the owned rows as the reducer left it (in the reduction dtype); when it has ``local``'s dtype it is also
    ``local.grad``, otherwise the optimizer step gives ``local`` an fp32 copy for the duration of the step.
    """

    name: str
    full: torch.nn.Parameter
    spec: ShardSpec
    local: torch.nn.Parameter
    grad: Tensor | None = None

    @property
    def trainable(self) -> bool:
        return self.full.requires_grad

    def set_grad(self, grad: Tensor) -> None:
        self.grad = grad
        if grad.dtype == self.local.dtype:
            self.local.grad = grad

    def clear_grad(self, set_to_none: bool) -> None:
        """What ``optimizer.zero_grad(set_to_none)`` means for the reduced gradient."""
        if self.grad is not None:
            if set_to_none:
                self.grad = None
            else:
                self.grad.zero_()


def shard_parameters(
    named_params: Iterable[tuple[str, torch.nn.Parameter]],
    rank: int,
    world_size: int,
    detached: dict[torch.nn.Parameter, tuple[torch.Size, Tensor]] | None = None,
    master_dtype: torch.dtype | None = None,
) -> list[ParamShard]:
    """Make a :class:`ParamShard` per parameter.

    Without ``detached`` each local shard is a view of the owned rows of the full parameter (stages 1 and 2), or a
    copy in ``master_dtype`` when that is given. With it, each parameter maps to its full shape and its standalone
    local rows (stage 3, where the full parameter is freed between uses).
    """
    shards = []
    for name, param in named_params:
        if detached is None:
            spec = ShardSpec(param.shape, rank, world_size)
            rows = spec.local_view(param.detach())
            if master_dtype is not None:
                rows = rows.to(master_dtype, copy=True)
        else:
            shape, rows = detached[param]
            spec = ShardSpec(shape, rank, world_size)
        shards.append(ParamShard(name, param, spec, torch.nn.Parameter(rows, requires_grad=param.requires_grad)))
    return shards


def group_into_buckets(shards: Sequence[ParamShard], bucket_bytes: int) -> list[list[ParamShard]]:
    """Consecutive buckets of shards of one dtype and device whose full flat buffer stays within ``bucket_bytes``.

    A parameter larger than the cap gets a bucket of its own; order is preserved.
    """
    buckets: list[list[ParamShard]] = []
    current: list[ParamShard] = []
    current_bytes = 0
    for shard in shards:
        size = shard.spec.padded_numel * shard.spec.world_size * shard.full.element_size()
        same_kind = not current or (current[0].full.dtype, current[0].full.device) == (shard.full.dtype, shard.full.device)
        if current and (not same_kind or current_bytes + size > bucket_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(shard)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets
