"""Block quantization of flat tensors, the format ZeRO++'s quantized collectives send (quantize.py: the package's
entry point, which adds the rank-major segments and qgZ's two-stage reduce-scatter): a tensor into a byte payload of
fp32 block scales and int8 or int4 codes, and back. Nothing here calls ``torch.distributed``.

[Note: the block-quantized payload]
A flat tensor of ``n`` elements (fp32, bf16 or fp16) is cut into blocks of ``B = block_size`` consecutive elements,
the last one shorter when ``B`` does not divide ``n``. Each block gets one fp32 scale ``s`` and each element ``x`` a
signed integer code ``q = round(x / s)`` (to nearest, ties to even) in ``[-qmax, qmax]``: ``qmax = 127`` for int8, one
byte per code, and ``7`` for int4, two codes per byte (element ``2i`` in the low nibble, ``2i + 1`` in the high one,
each as a 4-bit two's complement). Dequantizing computes ``q * s`` in fp32.

A payload is one uint8 tensor: ``[scales: 4 * ceil(n / B) bytes | codes: n bytes (int8), ceil(n / 2) (int4) | 0-3 zero
bytes]``, its length (``PayloadLayout.nbytes``, exact) rounded up to a multiple of 4 so that payloads laid end to end
(an all-gather's output, an all-to-all's chunks) each keep their scales readable as fp32 in place. Per element that is
``1 + 4/B`` bytes for int8 and ``1/2 + 4/B`` for int4: ``0.25 + 1/B`` and ``0.125 + 1/B`` of fp32's bytes, ``0.5 +
2/B`` and ``0.25 + 2/B`` of bf16's. An all-zero payload is a valid one: every block zero.

Why a scale per block: with one scale per tensor, one large value (an outlier gradient, a spike in an embedding row)
sets the step for millions of elements, most of which then round to 0; one per element saves nothing. With blocks,
an element's error is set by the largest value of its own block. Why ``B = 4096`` by default, the low end of the
4K-8K elements ZeRO++ uses: the bytes hardly differ across that range (the scales cost 0.1% of an int8 payload and
0.2% of an int4 one at 4096, half that at 8192), while the error does. Measured on a small GPT's flat gradient
(``benchmarks/quantize_speed.py --sweep``: 3.3M elements, one backward), the relative L2 error of the round trip is
0.0134 (int8) and 0.214 (int4) at 4096 against 0.0159 and 0.241 at 8192. Smaller blocks keep lowering it (int4: 0.189
at 2048, 0.166 at 1024, for 0.2% and 0.6% more bytes), the knob to turn if qgZ's convergence asks for it; the CPU time
hardly depends on ``B`` from 1024 up. A block that is a power of two also lines up with the rows of most matrices.

The scale and the error bound. ``s`` is the smallest fp32 not below ``absmax / qmax`` (``absmax``: the block's largest
``|x|``), so ``|x| / s <= qmax`` for every element: no code is ever clipped, and no clamp is needed; the largest
``|x|`` maps to exactly ``±qmax`` (``absmax / s >= qmax * (1 - 2**-23)`` when ``s`` is a normal fp32). An element's
error is then at most ``s / 2``, about ``absmax / (2 * qmax)``, plus float rounding, each bounded in ``ulp(absmax)``,
the spacing of fp32 numbers at ``absmax`` (at least ``2**-149``):

- rounding the scale up: ``s - absmax / qmax <= ulp(absmax / qmax) <= ulp(absmax) / 4``, so ``s / 2`` exceeds
  ``absmax / (2 * qmax)`` by at most ``ulp(absmax) / 8``;
- the fp32 quotient ``x / s`` is off by at most ``|x / s| * 2**-24``, which can move it across a half by that much:
  at most ``|x| * 2**-24 < ulp(absmax)`` in the value;
- the fp32 product ``q * s`` when dequantizing: at most half an ulp of ``|q * s| < 2 * absmax``, so ``ulp(absmax)``.

So ``|x - dequantized| <= absmax / (2 * qmax) + 3 * ulp(absmax)`` (``error_bound``), about ``2**-21 * absmax`` above
the ideal bound; the tests check it for every element. Dequantizing into bf16 or fp16 rounds that fp32 value once
more, by at most half an ulp of that dtype at the value.

Where the scale is not that fp32: (1) ``absmax / qmax`` below the smallest normal fp32 (``absmax < qmax * 2**-126``,
about 1.5e-36 for int8): rounding up can then add up to ``2**-149``, a large part of the scale, so the largest value
may map to fewer than ``qmax`` codes; the bound above still holds, with ``ulp = 2**-149``. (2) ``absmax`` within about
two ulps of fp32's largest value: ``qmax * s`` would round to inf on dequantizing, so ``s`` is the fp32 just below
``absmax / qmax``; the largest value's quotient is then at most ``qmax * (1 + 2**-22)``, still code ``qmax``. A block
whose ``absmax`` is 0 (zeros, negative zeros, padding) has scale 0 and codes 0 and dequantizes to ``+0.0`` exactly (the
sign of ``-0.0`` is not kept).

Non-finite values are never quantized silently. A block holding an inf or a NaN gets scale NaN; its codes are
unspecified (what the device makes of converting NaN to an integer) and it dequantizes to NaN in every element, so a
payload dequantized anyway cannot pass for finite data. ``quantize`` also returns ``nonfinite``, a 0-d bool tensor on
the input's device (no host sync), True when any block held one: the step's non-finite policy agrees on it across
ranks like on any other overflow flag.

[Note: chunks on the CPU]
The per-element work needs an fp32 temporary: the quotients before they are rounded, the products before a cast to a
16-bit dtype or a sum. On the CPU a fresh temporary the size of a bucket costs more than the arithmetic, because
every one of its pages is touched for the first time: measured on this project's machine (25M fp32 elements, one
thread), the division into a new tensor took 57 ms, into a reused one 12 ms, and division, rounding and the cast to
int8 over chunks of 1M elements reusing one 4 MiB scratch 12 ms against 65 ms in one piece. So on the CPU the work
runs over chunks of whole blocks of about ``_CPU_CHUNK_ELEMENTS`` elements (a loop of ``numel / 2**20`` steps, each
vectorized over all the blocks of its chunk; chunks of 64K elements were 3x slower, of 4M 2x). The block maxima are
taken chunk by chunk too, so that the division reads a chunk from the cache rather than from memory (int8 quantize of
the 25M elements: 21 ms against 35 ms with the maxima taken over the whole tensor first). On an accelerator the
caching allocator hands back warm memory and every chunk would cost kernel launches, so a part is one chunk there.
The bits are the same either way: every step is element-wise or per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

#: Elements per block (see [Note: the block-quantized payload] for the choice).
DEFAULT_BLOCK_SIZE = 4096
#: The bits qgZ's first stage sends inside the node, whatever ``quantize_grads`` asks for across nodes
#: (quantized_collectives.py, [Note: qgZ's two formats]).
INTRA_NODE_BITS = 8

_QMAX = {8: 127, 4: 7}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: A payload's length is a multiple of this, so that its fp32 scales stay aligned wherever it lies.
_ALIGN = 4
#: Elements per step of the per-element work on the CPU (see [Note: chunks on the CPU]).
_CPU_CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class BlockFormat:
    """Symmetric block quantization: ``bits`` 8 (int8, qmax 127) or 4 (int4, qmax 7, two codes per byte), one fp32
    scale per ``block_size`` elements."""

    bits: int = 8
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.bits not in _QMAX:
            raise ValueError(f"BlockFormat.bits={self.bits!r} is not supported; allowed: 8 (int8) or 4 (int4)")
        if not isinstance(self.block_size, int) or self.block_size < 2 or self.block_size % 2:
            raise ValueError(
                f"BlockFormat.block_size={self.block_size!r} must be an even integer >= 2 (int4 packs codes in pairs)"
            )

    @property
    def qmax(self) -> int:
        return _QMAX[self.bits]

    def layout(self, numel: int) -> PayloadLayout:
        """Where the scales and codes of ``numel`` quantized elements lie in their payload."""
        return PayloadLayout(self, numel)


@dataclass(frozen=True)
class PayloadLayout:
    """The byte layout of one quantized flat tensor of ``numel`` elements (see [Note: the block-quantized payload])."""

    fmt: BlockFormat
    numel: int

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise ValueError(f"PayloadLayout.numel={self.numel} must be >= 0")

    @property
    def full_blocks(self) -> int:
        return self.numel // self.fmt.block_size

    @property
    def tail(self) -> int:
        """Elements of the last, partial block (0 when the block size divides ``numel``)."""
        return self.numel - self.full_blocks * self.fmt.block_size

    @property
    def blocks(self) -> int:
        return self.full_blocks + (self.tail > 0)

    @property
    def scale_bytes(self) -> int:
        return 4 * self.blocks

    @property
    def code_bytes(self) -> int:
        return self.numel if self.fmt.bits == 8 else -(-self.numel // 2)

    @property
    def nbytes(self) -> int:
        """The payload's exact size in bytes, alignment padding included."""
        return -(-(self.scale_bytes + self.code_bytes) // _ALIGN) * _ALIGN

    def ratio(self, dtype: torch.dtype) -> float:
        """Payload bytes per byte of the unquantized tensor in ``dtype``."""
        return self.nbytes / (self.numel * dtype.itemsize) if self.numel else 0.0

    def scales(self, payload: Tensor) -> Tensor:
        """The fp32 scales of a payload ``(..., nbytes)``, as a view ``(..., blocks)``."""
        return payload[..., : self.scale_bytes].view(torch.float32)

    def codes(self, payload: Tensor) -> Tensor:
        """The code bytes of a payload ``(..., nbytes)``, as a uint8 view ``(..., code_bytes)``."""
        return payload[..., self.scale_bytes : self.scale_bytes + self.code_bytes]

    def parts(self, values: Tensor, payload: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
        """``(values, scales, codes)`` views of the whole blocks and of the partial last one, each shaped
        ``(..., blocks, L)``, ``(..., blocks)`` and ``(..., blocks, code bytes of L)``."""
        if self.numel == 0:
            return []
        block, whole = self.fmt.block_size, self.full_blocks * self.fmt.block_size
        per_byte = 1 if self.fmt.bits == 8 else 2
        scales, codes = self.scales(payload), self.codes(payload)
        parts = []
        if self.full_blocks:
            parts.append((
                values[..., :whole].unflatten(-1, (self.full_blocks, block)),
                scales[..., : self.full_blocks],
                codes[..., : whole // per_byte].unflatten(-1, (self.full_blocks, block // per_byte)),
            ))
        if self.tail:
            parts.append((
                values[..., whole:].unsqueeze(-2),
                scales[..., self.full_blocks :],
                codes[..., whole // per_byte :].unsqueeze(-2),
            ))
        return parts


class Quantized(NamedTuple):
    """A payload ``(..., nbytes)`` of uint8, and whether any block held an inf or a NaN (a 0-d bool tensor on the
    input's device)."""

    payload: Tensor
    nonfinite: Tensor


def block_scales(absmax: Tensor, qmax: int) -> Tensor:
    """Per-block fp32 scales from the blocks' largest ``|x|`` (see [Note: the block-quantized payload]): the smallest
    fp32 not below ``absmax / qmax``, or the one below it where ``qmax`` times it would overflow; 0 for a zero block,
    NaN for a non-finite one."""
    absmax = absmax.float().abs()  # a block of zeros can have a maximum of -0.0
    scale = absmax / qmax
    below = scale.double() * qmax < absmax.double()  # exact in fp64: 24 bits times 7
    scale = torch.where(below, scale.nextafter(torch.full_like(scale, math.inf)), scale)
    overflows = torch.isinf(scale * qmax) & absmax.isfinite()
    scale = torch.where(overflows, scale.nextafter(torch.zeros_like(scale)), scale)
    return torch.where(absmax.isfinite(), scale, math.nan)


def fp32_ulp(values: Tensor) -> Tensor:
    """The spacing of fp32 numbers at ``|values|`` (fp64; ``2**-149`` at and below the smallest normal)."""
    magnitude = values.double().abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2**exponent, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(magnitude), exponent - 24)
    return torch.where(magnitude < 2.0**-126, 2.0**-149, ulp)


def error_bound(absmax: Tensor, fmt: BlockFormat) -> Tensor:
    """Largest error of an fp32 dequantized element of a block whose largest ``|x|`` is ``absmax`` (fp64)."""
    absmax = absmax.double()
    return absmax / (2 * fmt.qmax) + 3 * fp32_ulp(absmax)


def quantize(values: Tensor, fmt: BlockFormat, out: Tensor | None = None) -> Quantized:
    """Quantize ``values`` ``(..., n)`` (fp32, bf16 or fp16, any strides; a 0-d tensor counts as one element) row by
    row into a payload ``(..., nbytes)`` (``out``, or a new one; see [Note: the block-quantized payload])."""
    if values.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize: values.dtype={values.dtype} is not one of {_FLOAT_DTYPES}")
    values = values.reshape(1) if values.dim() == 0 else values
    layout = fmt.layout(values.shape[-1])
    payload = _payload_out(out, (*values.shape[:-1], layout.nbytes), values.device)
    nonfinite = torch.zeros((), dtype=torch.bool, device=values.device)
    for part in layout.parts(values, payload):
        nonfinite |= _quantize_blocks(*part, fmt)
    payload[..., layout.scale_bytes + layout.code_bytes :].zero_()
    return Quantized(payload, nonfinite)


def dequantize(
    payload: Tensor,
    fmt: BlockFormat,
    numel: int,
    dtype: torch.dtype = torch.float32,
    out: Tensor | None = None,
    accumulate: bool = False,
) -> Tensor:
    """The values ``(..., numel)`` of a payload ``(..., nbytes)``, computed in fp32 and returned in ``dtype`` (or
    written into ``out``, whose dtype then wins). With ``accumulate``, added to ``out`` instead, which must be fp32
    (qgZ's sums: each payload dequantized, then added)."""
    layout = fmt.layout(numel)
    if payload.dtype != torch.uint8 or payload.shape[-1] != layout.nbytes:
        raise ValueError(
            f"dequantize: payload of dtype {payload.dtype} and last dim {payload.shape[-1]}; expected uint8 and "
            f"{layout.nbytes} bytes for {numel} elements as {fmt}"
        )
    shape = (*payload.shape[:-1], numel)
    _check_out(out, shape, accumulate)
    result = torch.empty(shape, dtype=dtype, device=payload.device) if out is None else out
    mode = "add" if accumulate else "write" if result.dtype == torch.float32 else "cast"
    for part in layout.parts(result, payload):
        _dequantize_blocks(*part, fmt, mode)
    return result


def _payload_out(out: Tensor | None, shape: tuple[int, ...], device: torch.device) -> Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or tuple(out.shape) != shape or out.device != device:
        raise ValueError(
            f"quantize: out has dtype {out.dtype}, shape {tuple(out.shape)} on {out.device}; "
            f"expected uint8, {shape} on {device}"
        )
    return out


def _check_out(out: Tensor | None, shape: tuple[int, ...], accumulate: bool) -> None:
    if out is None:
        if accumulate:
            raise ValueError("dequantize: accumulate=True needs an fp32 out to add to")
        return
    if tuple(out.shape) != shape:
        raise ValueError(f"dequantize: out has shape {tuple(out.shape)}; expected {shape}")
    if accumulate and out.dtype != torch.float32:
        raise ValueError(f"dequantize: accumulate=True adds in fp32, but out.dtype={out.dtype}")


def _chunks(values: Tensor) -> list[slice]:
    """Slices of the blocks dim of ``values`` ``(..., blocks, L)`` handled per step (see [Note: chunks on the
    CPU]): all blocks at once on an accelerator, about ``_CPU_CHUNK_ELEMENTS`` elements at a time on the CPU."""
    blocks = values.shape[-2]
    if values.device.type != "cpu":
        return [slice(0, blocks)]
    per = max(1, _CPU_CHUNK_ELEMENTS // max(1, math.prod(values.shape[:-2]) * values.shape[-1]))
    return [slice(i, min(i + per, blocks)) for i in range(0, blocks, per)]


def _scratch(values: Tensor, chunks: list[slice]) -> Tensor:
    """An fp32 tensor shaped like the first (largest) chunk of ``values``, reused by every chunk."""
    return torch.empty(values[..., chunks[0], :].shape, dtype=torch.float32, device=values.device)


def _quantize_blocks(values: Tensor, scales: Tensor, codes: Tensor, fmt: BlockFormat) -> Tensor:
    """Quantize ``values`` ``(..., blocks, L)`` into ``scales`` and ``codes``; returns whether a block held an inf or
    a NaN."""
    chunks = _chunks(values)
    scratch = _scratch(values, chunks)
    nonfinite = torch.zeros((), dtype=torch.bool, device=values.device)
    for chunk in chunks:
        part = values[..., chunk, :]
        absmax = torch.maximum(part.amax(-1), part.amin(-1).neg())  # no |x| temporary; NaN propagates
        scale = block_scales(absmax, fmt.qmax)
        scales[..., chunk].copy_(scale)
        divisor = torch.where(scale > 0, scale, math.inf).unsqueeze(-1)  # zero blocks: codes 0; non-finite: NaN
        quotient = scratch[..., : chunk.stop - chunk.start, :]
        torch.div(part, divisor, out=quotient).round_()
        if fmt.bits == 8:
            codes[..., chunk, :].view(torch.int8).copy_(quotient)
        else:
            _pack_int4(quotient.to(torch.int8), codes[..., chunk, :])
        nonfinite |= ~absmax.isfinite().all()
    return nonfinite


def _pack_int4(q: Tensor, codes: Tensor) -> None:
    """Pack int8 codes in [-8, 7] ``(..., L)`` two per byte into ``codes`` ``(..., ceil(L / 2))``: low nibble
    ``q[2i] & 15``, high nibble ``q[2i + 1]``. Read as int16, a pair is ``q[2i]`` in the low byte and ``q[2i + 1]``
    in the high one (little-endian, as on every device torch runs collectives on)."""
    if q.shape[-1] % 2:
        q = F.pad(q, (0, 1))
    pairs = q.view(torch.int16)
    torch.add(pairs.bitwise_and(15), pairs.bitwise_right_shift(8), alpha=16, out=codes.view(torch.int8))


def _unpack_int4(codes: Tensor, values: Tensor) -> None:
    """Write the int4 codes packed in ``codes`` ``(..., ceil(L / 2))`` into ``values`` ``(..., L)``."""
    packed = codes.view(torch.int8)
    high = packed.bitwise_right_shift(4)  # arithmetic: the high nibble's sign extends
    low = packed.bitwise_and(15).bitwise_xor_(8).sub_(8)  # nibble 8..15 -> -8..-1
    pairs = values.shape[-1] // 2
    even = values[..., : 2 * pairs].unflatten(-1, (pairs, 2))
    even[..., 0].copy_(low[..., :pairs])
    even[..., 1].copy_(high[..., :pairs])
    if values.shape[-1] % 2:
        values[..., -1].copy_(low[..., -1])


def _dequantize_blocks(values: Tensor, scales: Tensor, codes: Tensor, fmt: BlockFormat, mode: str) -> None:
    """Compute ``codes * scales`` in fp32 into ``values`` ``(..., blocks, L)``: write it there (``mode="write"``,
    fp32 ``values``), round it to ``values``' dtype (``"cast"``) or add it (``"add"``, fp32 ``values``)."""
    chunks = _chunks(values)
    scratch = None if mode == "write" else _scratch(values, chunks)
    for chunk in chunks:
        target = values[..., chunk, :]
        product = target if scratch is None else scratch[..., : chunk.stop - chunk.start, :]
        if fmt.bits == 8:
            product.copy_(codes[..., chunk, :].view(torch.int8))
        else:
            _unpack_int4(codes[..., chunk, :], product)
        product.mul_(scales[..., chunk].unsqueeze(-1))
        if mode == "add":
            target.add_(product)
        elif mode == "cast":
            target.copy_(product)
