"""The buckets that move parameter shards: shards of one dtype and device laid out rank-major in one flat buffer for
one collective (see [Note: how a parameter is split] in flat_param.py), and how parameters are grouped into them.

[Note: a large parameter is its own buffer]
A parameter whose rows split evenly (no padding) is already laid out rank-major: chunk ``r`` is segment ``r``. Stages
1 and 2 give each such parameter of at least ``inplace_mb`` a bucket of its own (``make_buckets(alone_bytes=...)``),
and its collectives run on the tensor itself (``Bucket.own_buffer``): the gradient is reduced where autograd left it,
the parameter is gathered straight into its storage. Nothing is packed or unpacked and no bucket buffer is held for
it, which is how ``DistributedDataParallel(gradient_as_bucket_view=True)`` and ``ZeroRedundancyOptimizer`` avoid a
second copy of the gradients; the small parameters (norms, biases, odd shapes) still fill packed buckets, which stay
open across the large ones so that they remain few. The price is more, smaller collectives: cheap on NCCL, a few
percent of a step on gloo (measured in BENCHMARKS.md).

Alternative considered: one flat concatenation of all parameters with each rank owning a contiguous 1/N (DeepSpeed,
FSDP1). It balances perfectly and avoids the pack copies, but hands the optimizer ragged pieces of matrices, forbids
frozen and trainable parameters in one buffer, and makes state dicts and resharding need communication. Dim-0
shards keep every shard a rectangular slice of a named parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero.sharding.flat_param import ParamShard


class Bucket:
    """Shards of one dtype and device that one collective moves, and their rank-major layout
    (see [Note: how a parameter is split]).

    ``segment_numel`` is the per-rank segment ``S``; a full buffer has ``world_size * S`` elements of ``dtype``.
    """

    def __init__(self, shards: Sequence[ParamShard], dtype: torch.dtype | None = None) -> None:
        if not shards:
            raise ValueError("a Bucket needs at least one parameter")
        self.shards = list(shards)
        first = self.shards[0]
        self.world_size = first.spec.world_size
        self.rank = first.spec.rank
        self.dtype = dtype or first.dtype
        self.device = first.device
        self.padded_numels = [s.spec.padded_numel for s in self.shards]
        self.segment_numel = sum(self.padded_numels)
        self._offsets = [0]
        for size in self.padded_numels[:-1]:
            self._offsets.append(self._offsets[-1] + size)

    @property
    def full_numel(self) -> int:
        return self.world_size * self.segment_numel

    @property
    def unpadded_numel(self) -> int:
        return sum(s.spec.numel for s in self.shards)

    def __len__(self) -> int:
        return len(self.shards)

    def empty(self, numel: int | None = None) -> Tensor:
        return torch.empty(self.full_numel if numel is None else numel, dtype=self.dtype, device=self.device)

    def segment(self, buffer: Tensor, rank: int | None = None) -> Tensor:
        """Rank ``rank``'s (default: this rank's) segment of a full rank-major buffer."""
        return buffer.view(self.world_size, self.segment_numel)[self.rank if rank is None else rank]

    def own_buffer(self, tensors: Sequence[Tensor | None]) -> Tensor | None:
        """The one tensor of ``tensors`` that already is this bucket's rank-major buffer, flattened, or ``None``: a
        bucket of one evenly split parameter whose full tensor is contiguous, of the bucket's dtype and on its device
        (see [Note: a large parameter is its own buffer])."""
        if len(self.shards) != 1 or self.shards[0].spec.numel != self.full_numel:
            return None
        tensor = tensors[0]
        if tensor is None or tensor.dtype != self.dtype or tensor.device != self.device or not tensor.is_contiguous():
            return None
        return tensor.detach().view(-1)

    def pack(self, tensors: Sequence[Tensor | None], out: Tensor) -> None:
        """Write full-shape tensors (``None`` counts as zeros) into the rank-major buffer ``out``, casting to its
        dtype and zeroing the padding (nothing to do when ``out`` is the tensor itself: ``own_buffer``)."""
        if _is_whole(out, tensors):
            return
        inputs = []
        for shard, tensor in zip(self.shards, tensors):
            if tensor is None:
                tensor = torch.zeros(shard.spec.shape, dtype=out.dtype, device=out.device)
            inputs.append(tensor.reshape(shard.spec.rows, -1))
        torch._chunk_cat(inputs, dim=0, num_chunks=self.world_size, out=out.view(self.world_size, -1))

    def pack_local(self, tensors: Sequence[Tensor], segment: Tensor) -> None:
        """Write this rank's unpadded shards into its segment (cast to the segment's dtype), zeroing the padding."""
        if _is_whole(segment, tensors):
            return  # the segment is the shard itself: a parameter gathered in place whose rows are its shard
        if any(t.device != segment.device for t in tensors):  # shards kept on the host (offload_params): copy over
            for shard, tensor, view in zip(self.shards, tensors, self._segment_views(segment)):
                view[: shard.spec.local_numel].copy_(tensor.reshape(-1), non_blocking=True)
                view[shard.spec.local_numel :].zero_()
            return
        pieces = []
        for shard, tensor in zip(self.shards, tensors):
            pieces.append(tensor.reshape(-1))
            pad = shard.spec.padded_numel - shard.spec.local_numel
            if pad:
                pieces.append(torch.zeros(pad, dtype=segment.dtype, device=segment.device))
        torch.cat(pieces, out=segment)

    def _segment_views(self, segment: Tensor) -> list[Tensor]:
        return [segment[offset : offset + padded] for offset, padded in zip(self._offsets, self.padded_numels)]

    def unpack(self, buffer: Tensor, tensors: Sequence[Tensor]) -> None:
        """Copy a rank-major buffer into full-shape tensors of any strides, dropping the padding."""
        if _is_whole(buffer, tensors):
            return
        outs, staged = [], []
        for shard, tensor, padded in zip(self.shards, tensors, self.padded_numels):
            direct = (shard.spec.numel == self.world_size * padded and tensor.is_contiguous()
                      and tensor.dtype == buffer.dtype)
            if direct:
                outs.append(tensor.view(self.world_size, padded))
            else:
                out = torch.empty(self.world_size, padded, dtype=buffer.dtype, device=buffer.device)
                outs.append(out)
                staged.append((tensor, out.view(-1)[: shard.spec.numel].view(shard.spec.shape)))
        torch.split_with_sizes_copy(buffer.view(self.world_size, -1), self.padded_numels, dim=1, out=outs)
        if staged:
            torch._foreach_copy_([dst for dst, _ in staged], [src for _, src in staged])

    def unpack_to_storage(self, buffer: Tensor, storage: Tensor | None = None) -> list[Tensor]:
        """Copy a rank-major buffer into one parameter-major tensor of ``full_numel`` elements (``storage``, or a
        new one); returns each parameter's (padded) piece of it, to be viewed at its shape (stage 3 unsharding: one
        copy, no staging)."""
        if storage is None:
            storage = torch.empty(self.full_numel, dtype=buffer.dtype, device=buffer.device)
        pieces = self.storage_pieces(storage)
        outs = [piece.view(self.world_size, p) for piece, p in zip(pieces, self.padded_numels)]
        torch.split_with_sizes_copy(buffer.view(self.world_size, -1), self.padded_numels, dim=1, out=outs)
        return pieces

    def storage_pieces(self, storage: Tensor) -> list[Tensor]:
        """Each parameter's (padded) piece of a parameter-major tensor of ``full_numel`` elements."""
        return list(storage.split([self.world_size * p for p in self.padded_numels]))

    def local_views(self, segment: Tensor) -> list[Tensor]:
        """Per-parameter views of the unpadded shards inside one rank's segment, at their local shapes."""
        return [
            segment[offset : offset + shard.spec.local_numel].view(shard.spec.local_shape)
            for shard, offset in zip(self.shards, self._offsets)
        ]


def _is_whole(buffer: Tensor, tensors: Sequence[Tensor | None]) -> bool:
    """Whether ``buffer`` is exactly the memory of the single tensor in ``tensors``."""
    return (
        len(tensors) == 1
        and tensors[0] is not None
        and tensors[0].data_ptr() == buffer.data_ptr()
        and tensors[0].numel() == buffer.numel()
    )


def make_buckets(
    shards: Sequence[ParamShard], bucket_bytes: int, dtype: torch.dtype | None = None, alone_bytes: int | None = None
) -> list[Bucket]:
    """Consecutive buckets of shards of one dtype and device whose full buffer stays within ``bucket_bytes``.

    ``dtype`` overrides the buffer dtype (a reduction in fp32 of 16-bit gradients) for floating-point parameters. A
    parameter larger than the cap gets a bucket of its own, and so does an evenly split one of at least
    ``alone_bytes`` (see [Note: a large parameter is its own buffer]); order is preserved.
    """
    buckets: list[Bucket] = []
    current: list[ParamShard] = []
    current_bytes = 0

    def kind(shard: ParamShard) -> tuple[torch.dtype, torch.device]:
        return shard.dtype, shard.device

    for shard in shards:
        if shard.spec.numel == 0:
            continue
        if alone_bytes is not None and shard.spec.numel == shard.spec.padded_numel * shard.spec.world_size:
            buffer_dtype = _buffer_dtype(shard, dtype)  # another dtype (a reduction in fp32) always needs a buffer
            if buffer_dtype == shard.dtype and shard.spec.numel * buffer_dtype.itemsize >= alone_bytes:
                buckets.append(Bucket([shard], buffer_dtype))  # the packed bucket being filled stays open
                continue
        size = shard.spec.padded_numel * shard.spec.world_size * shard.dtype.itemsize
        if current and (kind(current[0]) != kind(shard) or current_bytes + size > bucket_bytes):
            buckets.append(Bucket(current, _buffer_dtype(current[0], dtype)))
            current, current_bytes = [], 0
        current.append(shard)
        current_bytes += size
    if current:
        buckets.append(Bucket(current, _buffer_dtype(current[0], dtype)))
    return buckets


def _buffer_dtype(shard: ParamShard, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and shard.dtype.is_floating_point else shard.dtype
