"""Block quantization of flat tensors for ZeRO++'s quantized collectives (Wang et al., arXiv 2306.10209): qwZ's
int8 all-gather of weights and qgZ's int4/int8 two-stage reduce-scatter of gradients.

Nothing in this module calls ``torch.distributed``: it turns tensors into byte payloads and back, lays out the chunks
the collectives exchange, and computes on one process what a quantized reduce-scatter must produce, so that the
collectives can be tested against it. Every step is a few vectorized torch ops over many blocks at once, the same
ops on CPU and CUDA; the only Python loops are over the two parts of a tensor (whole blocks, the last partial block),
over chunks of about a million elements on the CPU ([Note: chunks on the CPU]) and, in the reductions, over the ranks
whose payloads are summed.

The payload's format and the per-block work are in quantize_blocks.py ([Note: the block-quantized payload], [Note:
chunks on the CPU]); this module lays out the rank-major segments the collectives quantize and computes qgZ's two
stages, and is where the rest of the package imports all of it from.

[Note: segments and the two-stage reduce-scatter]
The collectives quantize the rank-major buffers of ``flat_param.py`` ([Note: how a parameter is split]): ``N``
segments of ``S`` elements, segment ``r`` for rank ``r``. Each segment is quantized on its own (``quantize`` of the
``(N, S)`` view): blocks restart at each segment and never straddle two, so the payload of a segment is the same bytes
whichever rank makes it and wherever it lies, and each segment's last block is partial when ``B`` does not divide
``S``. ``quantize_segments`` also takes a flat tensor whose size is not a multiple of ``N`` (ceil-sized segments, the
last ones zero-padded): padding is zeros, which never raise a block's ``absmax``.

qgZ reduces gradients with two all-to-alls instead of one reduce-scatter (``TwoStageReduce``). ``N = G * K`` ranks
form ``G`` groups ("nodes") of ``K`` consecutive ranks, rank ``g * K + k``.

1. Inside the group: rank ``(g, k)`` sends to its peer ``(g, j)`` the ``G`` segments ``{g' * K + j}`` (the ``(G, K, S)``
   view transposed to ``(K, G, S)``, row ``j``), quantized into a ``(K, G, P)`` payload so that each row is one
   contiguous chunk of ``all_to_all_single``. Each rank dequantizes the ``K`` chunks it receives and sums them in fp32,
   in order of ``j``: the group's partial sums of the segments ``{g' * K + k}``.
2. Across groups: each rank requantizes its ``G`` partial sums and sends partial ``g'`` to rank ``(g', k)``, which
   dequantizes the ``G`` chunks it receives and sums them in fp32, in order of ``g``: its own segment, summed over all
   ``N`` ranks.

``TwoStageReduce.parts`` cuts each segment into consecutive parts (a bucket's parameters) whose blocks restart at
each part, so that the result is that of each part reduced on its own and one parameter's small gradients never share
a scale with another's large ones (quantized_collectives.py, [Note: the quantized reduce-scatter]); the payload of a
segment is then its parts' payloads end to end.

A stage with one member (``K = 1``, or ``G = 1``) is an exchange with oneself that saves no bytes; it is quantized all
the same, so that every topology runs the same steps and the reference stays one definition.

Every value is dequantized before it is summed, so quantization errors add and never compound: an element's error is
at most the sum, over the ``N`` source blocks and the ``G`` partial blocks it went through, of their ``error_bound``,
plus the rounding of the fp32 sums. Each rank sends ``(K - 1) * G * P1`` bytes inside its group and ``(G - 1) * P2``
across groups (``TwoStageReduce.intra_bytes``, ``inter_bytes``), against ``(N - 1) * S * itemsize`` for a flat
reduce-scatter. The sums are not averaged: divide before quantizing (as ``Collectives.reduce_scatter`` divides
before summing), which scales every block and its scale alike.

``reference_two_stage_reduce_scatter`` computes, from every rank's full buffer and with plain loops over ranks and
segments, what that must leave on each rank: the distributed version equals it bit for bit when it sums in the same
order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_zero.sharding.quantize_blocks import (
    DEFAULT_BLOCK_SIZE,
    INTRA_NODE_BITS,
    BlockFormat,
    PayloadLayout,
    Quantized,
    block_scales,
    dequantize,
    error_bound,
    fp32_ulp,
    quantize,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "INTRA_NODE_BITS",
    "BlockFormat",
    "PayloadLayout",
    "Quantized",
    "TwoStageReduce",
    "block_scales",
    "dequantize",
    "dequantize_segments",
    "error_bound",
    "fp32_ulp",
    "quantize",
    "quantize_segments",
    "reference_two_stage_reduce_scatter",
    "segment_numel",
    "sum_dequantized",
]


def segment_numel(numel: int, segments: int) -> int:
    """Elements per segment when ``numel`` elements are split into ``segments`` equal, zero-padded segments."""
    if segments < 1:
        raise ValueError(f"segments={segments} must be >= 1")
    return -(-numel // segments)


def quantize_segments(flat: Tensor, segments: int, fmt: BlockFormat) -> Quantized:
    """Quantize a rank-major flat tensor segment by segment into a payload ``(segments, nbytes)`` (see [Note:
    segments and the two-stage reduce-scatter]). A size that is not a multiple of ``segments`` is padded with zeros:
    the segments have ``ceil(numel / segments)`` elements and the last ones end in (or are all) padding."""
    flat = flat.reshape(-1)
    numel, size = flat.numel(), segment_numel(flat.numel(), segments)
    whole = numel // size if size else segments
    if whole == segments:
        return quantize(flat.view(segments, size), fmt)
    payload = torch.zeros(segments, fmt.layout(size).nbytes, dtype=torch.uint8, device=flat.device)  # zeros: 0.0
    nonfinite = quantize(flat[: whole * size].view(whole, size), fmt, out=payload[:whole]).nonfinite
    rest = flat[whole * size :]
    if rest.numel():
        padded = F.pad(rest, (0, size - rest.numel()))
        nonfinite |= quantize(padded, fmt, out=payload[whole]).nonfinite
    return Quantized(payload, nonfinite)


def dequantize_segments(
    payload: Tensor, fmt: BlockFormat, numel: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The flat ``numel`` values of a payload ``(segments, nbytes)`` made by ``quantize_segments``, padding dropped."""
    size = segment_numel(numel, payload.shape[0])
    return dequantize(payload, fmt, size, dtype).reshape(-1)[:numel]


@dataclass(frozen=True)
class TwoStageReduce:
    """qgZ's reduce-scatter of a rank-major buffer of ``groups * group_size`` segments of ``segment_numel`` elements
    as two quantized all-to-alls, inside the group then across groups (see [Note: segments and the two-stage
    reduce-scatter]). Rank ``g * group_size + k`` is member ``k`` of group ``g``. ``parts``: the sizes of consecutive
    parts of a segment (a bucket's parameters) whose blocks restart at each part, as if each part were reduced on its
    own; ``None``: the whole segment is one part."""

    groups: int
    group_size: int
    segment_numel: int
    intra: BlockFormat = BlockFormat(bits=4)
    inter: BlockFormat = BlockFormat(bits=4)
    parts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("groups", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"TwoStageReduce.{name}={getattr(self, name)} must be >= 1")
        if self.parts is not None and (sum(self.parts) != self.segment_numel or min(self.parts, default=0) < 0):
            raise ValueError(
                f"TwoStageReduce.parts={self.parts} must be sizes >= 0 adding up to segment_numel={self.segment_numel}"
            )

    @property
    def world_size(self) -> int:
        return self.groups * self.group_size

    def payload_bytes(self, fmt: BlockFormat) -> int:
        """The bytes of one segment's payload in ``fmt``: its parts' payloads end to end."""
        return sum(layout.nbytes for _, _, layout in self._layouts(fmt))

    @property
    def intra_bytes(self) -> int:
        """Bytes a rank sends to the other members of its group (its own chunk stays)."""
        return (self.group_size - 1) * self.groups * self.payload_bytes(self.intra)

    @property
    def inter_bytes(self) -> int:
        """Bytes a rank sends to the other groups."""
        return (self.groups - 1) * self.payload_bytes(self.inter)

    def intra_chunks(self, buffer: Tensor) -> Tensor:
        """A view ``(group_size, groups, segment_numel)`` of a rank-major buffer: row ``j`` holds the segments that go
        to member ``j`` of this rank's group, those of the ranks ``g * group_size + j``."""
        if buffer.numel() != self.world_size * self.segment_numel:
            raise ValueError(
                f"buffer has {buffer.numel()} elements; expected world_size * segment_numel = "
                f"{self.world_size} * {self.segment_numel}"
            )
        return buffer.view(self.groups, self.group_size, self.segment_numel).transpose(0, 1)

    def quantize_intra(self, buffer: Tensor) -> Quantized:
        """The first all-to-all's input: a contiguous payload ``(group_size, groups, nbytes)``, row ``j`` for
        member ``j``."""
        return self._quantize(self.intra_chunks(buffer), self.intra)

    def reduce_intra(self, received: Tensor) -> Tensor:
        """Sum in fp32 of the first all-to-all's output ``(group_size, groups, nbytes)`` (row ``j`` from member
        ``j``): ``(groups, segment_numel)``, row ``g`` the group's partial sum of segment ``g * group_size + k``."""
        return self._sum(received, self.intra)

    def quantize_inter(self, partial: Tensor) -> Quantized:
        """The second all-to-all's input: the partial sums ``(groups, segment_numel)`` as a payload ``(groups,
        nbytes)``, row ``g`` for the member of this rank's index in group ``g``."""
        return self._quantize(partial, self.inter)

    def reduce_inter(self, received: Tensor) -> Tensor:
        """Sum in fp32 of the second all-to-all's output ``(groups, nbytes)`` (row ``g`` from group ``g``): this
        rank's segment, summed over every rank."""
        return self._sum(received, self.inter)

    def _layouts(self, fmt: BlockFormat) -> list[tuple[slice, slice, PayloadLayout]]:
        """Per part: its elements in a segment, its bytes in a segment's payload, its layout."""
        out, start, offset = [], 0, 0
        for numel in (self.segment_numel,) if self.parts is None else self.parts:
            layout = fmt.layout(numel)
            out.append((slice(start, start + numel), slice(offset, offset + layout.nbytes), layout))
            start, offset = start + numel, offset + layout.nbytes
        return out

    def _quantize(self, values: Tensor, fmt: BlockFormat) -> Quantized:
        """``values`` ``(..., segment_numel)`` part by part into one contiguous payload ``(..., nbytes)``."""
        payload = torch.empty(*values.shape[:-1], self.payload_bytes(fmt), dtype=torch.uint8, device=values.device)
        nonfinite = torch.zeros((), dtype=torch.bool, device=values.device)
        for elements, nbytes, _ in self._layouts(fmt):
            nonfinite |= quantize(values[..., elements], fmt, out=payload[..., nbytes]).nonfinite
        return Quantized(payload, nonfinite)

    def _sum(self, payloads: Tensor, fmt: BlockFormat) -> Tensor:
        """``sum_dequantized`` of ``payloads`` ``(count, ..., nbytes)``, part by part: ``(..., segment_numel)``."""
        layouts = self._layouts(fmt)
        if len(layouts) == 1:
            return sum_dequantized(payloads, fmt, self.segment_numel)
        total = torch.empty(*payloads.shape[1:-1], self.segment_numel, dtype=torch.float32, device=payloads.device)
        for elements, nbytes, layout in layouts:
            total[..., elements] = sum_dequantized(payloads[..., nbytes], fmt, layout.numel)
        return total


def sum_dequantized(payloads: Tensor, fmt: BlockFormat, numel: int) -> Tensor:
    """``sum_i dequantize(payloads[i])`` in fp32, added in order of ``i`` (``payloads``: ``(count, ..., nbytes)``)."""
    total = dequantize(payloads[0], fmt, numel)
    for payload in payloads[1:]:
        dequantize(payload, fmt, numel, out=total, accumulate=True)
    return total


def reference_two_stage_reduce_scatter(
    buffers: Sequence[Tensor], group_size: int, intra: BlockFormat, inter: BlockFormat | None = None
) -> list[Tensor]:
    """What qgZ's two-stage reduce-scatter leaves on each rank, from every rank's rank-major buffer (``buffers[r]``
    is rank ``r``'s): for each rank, its segment summed over all ranks in fp32, each source segment quantized with
    ``intra`` and summed within its group, each group's partial sum quantized with ``inter`` (default: ``intra``) and
    summed across groups, in order of rank. Written with loops over ranks and segments, not the layout of
    ``TwoStageReduce``, to test that layout and the collectives that move it."""
    inter = intra if inter is None else inter
    world = len(buffers)
    if world % group_size:
        raise ValueError(f"{world} ranks do not split into groups of group_size={group_size}")
    if len({b.numel() for b in buffers}) != 1 or buffers[0].numel() % world:
        raise ValueError(
            f"buffers of {sorted({b.numel() for b in buffers})} elements; expected one size, a multiple of {world}"
        )
    size = buffers[0].numel() // world
    segments = [b.reshape(world, size) for b in buffers]
    result = []
    for dest in range(world):
        partials = []
        for first in range(0, world, group_size):
            sent = [quantize(segments[first + j][dest], intra).payload for j in range(group_size)]
            partials.append(sum_dequantized(torch.stack(sent), intra, size))
        sent = [quantize(partial, inter).payload for partial in partials]
        result.append(sum_dequantized(torch.stack(sent), inter, size))
    return result
