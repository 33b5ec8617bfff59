"""Block quantization with no processes: the error bound over edge cases, the payload's bytes, int4 packing,
non-finite blocks, per-segment layouts and the two-stage quantized reduce-scatter against an exact sum.

Every bound is checked against block maxima computed here again, in fp64, from the input; codes are decoded here
again from the payload's bytes (``_codes``), so that a wrong layout cannot pass through its own decoder.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_zero.sharding import quantize as quant
from lightning_zero.sharding import quantize_blocks
from lightning_zero.sharding.buckets import Bucket
from lightning_zero.sharding.flat_param import shard_parameters
from lightning_zero.sharding.quantize import (
    BlockFormat,
    TwoStageReduce,
    block_scales,
    dequantize,
    dequantize_segments,
    error_bound,
    quantize,
    quantize_segments,
    reference_two_stage_reduce_scatter,
)

FORMATS = [BlockFormat(8, 64), BlockFormat(4, 64)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SMALLEST_SUBNORMAL = 2.0**-149
SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _ids(value) -> str:
    return f"int{value.bits}" if isinstance(value, BlockFormat) else str(value).removeprefix("torch.")


def _block_absmax(values: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block maximum of ``|x|`` (fp64), blocks restarting on every row."""
    if values.numel() == 0:
        return values.double()
    rows = values.double().reshape(-1, values.shape[-1]).abs()
    n = rows.shape[-1]
    padded = torch.nn.functional.pad(rows, (0, -n % block)).view(rows.shape[0], -1, block)
    return padded.amax(-1).repeat_interleave(block, -1)[:, :n].reshape(values.shape)


def _codes(payload: torch.Tensor, fmt: BlockFormat, numel: int) -> torch.Tensor:
    """The integer codes of a 1-d payload, read from its bytes: low nibble first for int4, two's complement."""
    layout = fmt.layout(numel)
    raw = payload[layout.scale_bytes : layout.scale_bytes + layout.code_bytes].long()
    if fmt.bits == 8:
        return torch.where(raw > 127, raw - 256, raw)
    nibbles = torch.stack((raw & 15, raw >> 4), -1).flatten()[:numel]
    return torch.where(nibbles > 7, nibbles - 16, nibbles)


def _assert_within_bound(values: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Quantize ``values`` (1-d), check every element and code, and return the fp32 dequantized tensor."""
    n = values.numel()
    payload, nonfinite = quantize(values, fmt)
    assert payload.shape == (fmt.layout(n).nbytes,) and payload.dtype == torch.uint8
    assert nonfinite.shape == () and nonfinite.dtype == torch.bool and not nonfinite
    restored = dequantize(payload, fmt, n)
    absmax = _block_absmax(values, fmt.block_size)
    error = (values.double() - restored.double()).abs()
    assert (error <= error_bound(absmax, fmt)).all(), (error - error_bound(absmax, fmt)).max()
    codes = _codes(payload, fmt, n)
    assert codes.abs().max().item() <= fmt.qmax if n else True
    normal = absmax >= fmt.qmax * 2.0**-126  # where the scale is a normal fp32, the largest value is code ±qmax
    largest = values.double().abs() == absmax
    assert (codes[normal & largest].abs() == fmt.qmax).all()
    if values.dtype != torch.float32:  # a 16-bit result is the fp32 one, rounded once
        assert torch.equal(dequantize(payload, fmt, n, dtype=values.dtype), restored.to(values.dtype))
    return restored


def _edge_case(name: str, dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    info = torch.finfo(dtype)
    if name == "zeros":
        return torch.zeros(200, dtype=dtype)
    if name == "negative zeros":
        return torch.tensor([-0.0, 0.0, -0.0] * 30 + [-1.5, 0.25], dtype=dtype)
    if name == "one huge value":
        values = torch.randn(300) * 1e-3
        values[77] = float(info.max) / 4
        return values.to(dtype)
    if name == "denormals":  # the dtype's own subnormals, the smallest one, and blocks of nothing else
        tiny = float(info.smallest_normal)
        values = torch.randint(-200, 200, (300,)).double() * (tiny / 256)
        values[:3] = torch.tensor([tiny / 2**9, -tiny / 2**9, tiny])
        return values.to(dtype)
    if name == "fp32 denormals":  # absmax below qmax * 2**-126: subnormal scales
        return torch.tensor([190.0, -3.0, 1.0, 0.0, 127.0, 5.0] * 20, dtype=torch.float64).mul(2.0**-149).float()
    if name == "near the dtype's max":
        values = torch.tensor([1.0, -1.0, 0.999, 0.5, 1e-3, -0.75] * 20, dtype=torch.float64) * float(info.max)
        return values.to(dtype)
    if name == "blocks of different scales":  # from near the smallest normal to near the max of the dtype
        low, high = math.log10(float(info.smallest_normal)) + 3, math.log10(float(info.max)) - 2
        scales = torch.logspace(low, high, 5, dtype=torch.float64).unsqueeze(1)
        return (torch.randn(5, 64, dtype=torch.float64).clamp(-4, 4) * scales).flatten().to(dtype)
    if name == "randn":
        return torch.randn(1000).to(dtype)
    raise KeyError(name)


EDGE_CASES = [
    "zeros",
    "negative zeros",
    "one huge value",
    "denormals",
    "fp32 denormals",
    "near the dtype's max",
    "blocks of different scales",
    "randn",
]


@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
@pytest.mark.parametrize(
    "case,dtype",
    [(c, d) for c in EDGE_CASES for d in DTYPES if c != "fp32 denormals" or d == torch.float32],
    ids=lambda v: _ids(v) if isinstance(v, torch.dtype) else v,
)
def test_every_element_within_absmax_over_2_qmax(case: str, dtype: torch.dtype, fmt: BlockFormat) -> None:
    values = _edge_case(case, dtype)
    restored = _assert_within_bound(values, fmt)
    assert torch.isfinite(restored).all()
    if case in ("zeros", "negative zeros"):
        zero = values == 0
        assert (restored[zero] == 0).all() and not restored[zero].signbit().any()  # +0.0: the sign is not kept
    if case == "near the dtype's max":
        assert torch.isfinite(dequantize(quantize(values, fmt).payload, fmt, values.numel(), dtype=dtype)).all()


@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
@pytest.mark.parametrize("numel", [0, 1, 2, 63, 64, 65, 127, 129, 64 * 5 - 1])
def test_sizes_that_are_not_a_multiple_of_the_block(numel: int, fmt: BlockFormat) -> None:
    torch.manual_seed(numel)
    values = torch.randn(numel) * 3
    restored = _assert_within_bound(values, fmt)
    assert restored.shape == (numel,)
    if numel == 1:  # one element is its own block's maximum: exact up to the product's rounding
        assert restored.item() == pytest.approx(values.item(), rel=2**-22)
        scalar = quantize(values[0], fmt).payload  # a 0-d tensor is one element
        assert torch.equal(scalar, quantize(values, fmt).payload)


def test_default_block_size_on_a_tensor_of_several_blocks_and_a_tail() -> None:
    torch.manual_seed(0)
    values = torch.randn(3 * quant.DEFAULT_BLOCK_SIZE + 1001) * torch.rand(1).item()
    for bits in (8, 4):
        _assert_within_bound(values, BlockFormat(bits))


def test_payload_sizes_are_exact() -> None:
    fmt8, fmt4 = BlockFormat(8, 4096), BlockFormat(4, 4096)
    assert fmt8.layout(10000).nbytes == 3 * 4 + 10000  # 3 scales, 10000 codes, already a multiple of 4
    assert fmt4.layout(10001).nbytes == 5016  # 3 scales + ceil(10001 / 2) = 5013 bytes, aligned to 5016
    assert fmt8.layout(1).nbytes == 8 and fmt4.layout(1).nbytes == 8  # 4 + 1 code byte, aligned
    assert fmt8.layout(0).nbytes == 0 and fmt4.layout(0).nbytes == 0
    n = 4096 * 1000
    assert fmt8.layout(n).ratio(torch.float32) == pytest.approx(0.25 + 1 / 4096, abs=1e-12)
    assert fmt4.layout(n).ratio(torch.float32) == pytest.approx(0.125 + 1 / 4096, abs=1e-12)
    assert fmt4.layout(n).ratio(torch.bfloat16) == pytest.approx(0.25 + 2 / 4096, abs=1e-12)
    for fmt in (fmt8, fmt4):
        for numel in (0, 1, 4095, 4096, 4097, 12345):
            payload = quantize(torch.randn(numel), fmt).payload
            assert payload.numel() == fmt.layout(numel).nbytes and payload.numel() % 4 == 0


def test_payload_bytes_are_scales_then_codes() -> None:
    fmt = BlockFormat(4, 4)
    values = torch.tensor([7.0, -7.0, 1.0, -0.0, 0.5, 1.25, 2.0])  # blocks: absmax 7 (scale 1), 2 (scale 2/7)
    payload = quantize(values, fmt).payload
    scales = payload[:8].view(torch.float32)
    assert scales[0].item() == 1.0 and scales[1].item() == pytest.approx(2 / 7, rel=1e-7)
    assert scales[1].double() * 7 >= 2.0  # rounded up, never down
    # codes 7, -7, 1, 0 | 2 (0.5 / (2/7) = 1.75), 4 (4.375), 7; the odd last nibble is padded with 0
    assert payload[8:12].tolist() == [0x97, 0x01, 0x42, 0x07]
    assert payload.numel() == 12


def test_int4_packing_round_trips_every_pair_of_codes() -> None:
    codes = torch.arange(-8, 8, dtype=torch.int8)
    pairs = torch.cartesian_prod(codes, codes).flatten()  # all 256 (low, high) pairs
    packed = torch.empty(pairs.numel() // 2, dtype=torch.uint8)
    quantize_blocks._pack_int4(pairs, packed)
    assert sorted(packed.tolist()) == list(range(256))  # every byte value exactly once
    assert packed[0].item() == 0x88 and packed[-1].item() == 0x77  # (-8, -8) and (7, 7)
    restored = torch.empty(pairs.numel())
    quantize_blocks._unpack_int4(packed, restored)
    assert torch.equal(restored, pairs.float())
    odd = torch.empty(pairs.numel() - 1)
    quantize_blocks._unpack_int4(packed, odd)
    assert torch.equal(odd, pairs[:-1].float())


@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", [0, 64 * 2 + 10])  # the first whole block, the partial last one
def test_a_non_finite_value_sets_the_flag_and_poisons_only_its_block(where: int, bad: float, fmt: BlockFormat) -> None:
    torch.manual_seed(0)
    clean = torch.randn(64 * 2 + 20)
    dirty = clean.clone()
    dirty[where] = bad
    payload, nonfinite = quantize(dirty, fmt)
    assert nonfinite.shape == () and nonfinite.dtype == torch.bool and nonfinite.item()
    block = where // 64
    scales = fmt.layout(dirty.numel()).scales(payload)
    assert scales[block].isnan() and scales.isfinite().sum() == scales.numel() - 1
    restored = dequantize(payload, fmt, dirty.numel())
    poisoned = torch.zeros(dirty.numel(), dtype=torch.bool)
    poisoned[block * 64 : (block + 1) * 64] = True
    assert restored[poisoned].isnan().all()
    clean_restored = dequantize(quantize(clean, fmt).payload, fmt, clean.numel())
    assert torch.equal(restored[~poisoned], clean_restored[~poisoned])
    assert not quantize(clean, fmt).nonfinite


def test_nonfinite_flags_of_segments_and_of_bf16() -> None:
    fmt = BlockFormat(8, 64)
    buffer = torch.randn(4 * 50)
    buffer[3 * 50 + 7] = math.nan  # the last segment
    assert quantize_segments(buffer, 4, fmt).nonfinite
    assert not quantize_segments(buffer[: 3 * 50], 3, fmt).nonfinite
    assert quantize(torch.tensor([1.0, math.inf], dtype=torch.bfloat16), fmt).nonfinite


def test_block_scales_round_up_and_stay_finite() -> None:
    qmax = 127
    fp32_max = torch.finfo(torch.float32).max
    absmax = torch.tensor([0.0, 1.0, 127.0, 3.3e-3, 190 * SMALLEST_SUBNORMAL, fp32_max, math.inf, math.nan])
    scales = block_scales(absmax, qmax)
    assert scales[0].item() == 0.0
    assert scales[2].item() == 1.0
    assert scales[4].item() == 2 * SMALLEST_SUBNORMAL  # 190/127 of the smallest subnormal, rounded up
    assert scales[6].isnan() and scales[7].isnan()
    finite = slice(1, 5)
    exact = scales[finite].double() * qmax
    assert (exact >= absmax[finite].double()).all()  # never below: no code beyond qmax
    below = scales[finite].nextafter(torch.zeros(4)).double() * qmax
    assert (below < absmax[finite].double()).all()  # the smallest such fp32
    assert torch.isfinite(scales[5] * qmax)  # fp32's max: the scale just below, so the product stays finite
    assert scales[5].double() * qmax < fp32_max


def test_quantize_is_row_by_row_and_chunking_changes_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    rows = torch.randn(5, 300) * torch.logspace(-3, 3, 5).unsqueeze(1)
    for fmt in FORMATS:
        whole = quantize(rows, fmt).payload
        for r in range(5):
            assert torch.equal(whole[r], quantize(rows[r].clone(), fmt).payload)
        strided = quantize(rows.t().contiguous().t(), fmt).payload  # a non-contiguous input
        assert torch.equal(strided, whole)
        restored = dequantize(whole, fmt, 300)
        monkeypatch.setattr(quantize_blocks, "_CPU_CHUNK_ELEMENTS", 50)  # chunks of one block, and many of them
        assert torch.equal(quantize(rows, fmt).payload, whole)
        assert torch.equal(dequantize(whole, fmt, 300), restored)
        assert torch.equal(dequantize(whole, fmt, 300, dtype=torch.bfloat16), restored.bfloat16())
        monkeypatch.undo()


@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
def test_dequantize_into_out_and_accumulate(fmt: BlockFormat) -> None:
    torch.manual_seed(0)
    values = torch.randn(3, 150)
    payload = quantize(values, fmt).payload
    restored = dequantize(payload, fmt, 150)
    total = torch.randn(3, 150)
    expected = total + restored
    assert dequantize(payload, fmt, 150, out=total, accumulate=True) is total
    assert torch.equal(total, expected)
    half = torch.empty(3, 150, dtype=torch.float16)
    assert dequantize(payload, fmt, 150, out=half) is half
    assert torch.equal(half, restored.half())


def test_bad_arguments_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"BlockFormat.bits=3 .*allowed: 8 \(int8\) or 4"):
        BlockFormat(bits=3)
    with pytest.raises(ValueError, match="BlockFormat.block_size=4095 must be an even integer"):
        BlockFormat(block_size=4095)
    with pytest.raises(TypeError, match="values.dtype=torch.int32"):
        quantize(torch.ones(4, dtype=torch.int32), BlockFormat())
    fmt = BlockFormat(8, 64)
    payload = quantize(torch.randn(100), fmt).payload
    with pytest.raises(ValueError, match="last dim 108; expected uint8 and 56 bytes for 50 elements"):
        dequantize(payload, fmt, 50)
    with pytest.raises(ValueError, match="accumulate=True needs an fp32 out"):
        dequantize(payload, fmt, 100, accumulate=True)
    with pytest.raises(ValueError, match="accumulate=True adds in fp32, but out.dtype=torch.bfloat16"):
        dequantize(payload, fmt, 100, out=torch.zeros(100, dtype=torch.bfloat16), accumulate=True)
    with pytest.raises(ValueError, match=r"quantize: out has dtype torch.uint8, shape \(100,\)"):
        quantize(torch.randn(100), fmt, out=torch.empty(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"TwoStageReduce.group_size=0 must be >= 1"):
        TwoStageReduce(groups=2, group_size=0, segment_numel=10)
    with pytest.raises(ValueError, match="3 ranks do not split into groups of group_size=2"):
        reference_two_stage_reduce_scatter([torch.zeros(6)] * 3, 2, fmt)
    with pytest.raises(ValueError, match=r"buffers of \[6, 8\] elements; expected one size, a multiple of 2"):
        reference_two_stage_reduce_scatter([torch.zeros(6), torch.zeros(8)], 2, fmt)


# ----- segments -----


@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
@pytest.mark.parametrize("numel,segments", [(400, 4), (401, 4), (5, 4), (1, 4), (0, 3), (130, 1), (64 * 6, 3)])
def test_segments_quantize_independently(numel: int, segments: int, fmt: BlockFormat) -> None:
    torch.manual_seed(numel)
    flat = torch.randn(numel) * torch.logspace(-4, 4, numel if numel else 1)[:numel]  # segments of unlike scales
    payload, nonfinite = quantize_segments(flat, segments, fmt)
    size = -(-numel // segments)
    assert payload.shape == (segments, fmt.layout(size).nbytes) and not nonfinite
    padded = torch.nn.functional.pad(flat, (0, size * segments - numel))
    for r in range(segments):  # each row is the payload of that segment alone, its padding zeros
        assert torch.equal(payload[r], quantize(padded[r * size : (r + 1) * size].clone(), fmt).payload)
    restored = dequantize_segments(payload, fmt, numel)
    assert restored.shape == (numel,)
    if numel:  # bound per segment: a block never reaches into the next segment
        absmax = _block_absmax(padded.view(segments, size), fmt.block_size).flatten()[:numel]
        assert ((flat.double() - restored.double()).abs() <= error_bound(absmax, fmt)).all()


def test_a_bucket_buffer_round_trips_within_the_bound_of_its_segments() -> None:
    # A flat_param bucket (odd shapes, padded rows) quantized rank by rank: every parameter comes back within the
    # bound of the blocks it shares with its neighbours in its segment.
    torch.manual_seed(0)
    tensors = [torch.randn(7, 5) * 100, torch.randn(3), torch.randn(130) * 1e-3, torch.randn(2, 2, 3)]
    world, fmt = 4, BlockFormat(8, 16)
    bucket = Bucket(shard_parameters([(f"p{i}", torch.nn.Parameter(t)) for i, t in enumerate(tensors)], 0, world))
    buffer = bucket.empty()
    bucket.pack(tensors, buffer)
    payload, _ = quantize_segments(buffer, world, fmt)
    assert payload.shape == (world, fmt.layout(bucket.segment_numel).nbytes)
    restored_buffer = dequantize_segments(payload, fmt, buffer.numel())
    bounds = error_bound(_block_absmax(buffer.view(world, -1), 16).flatten(), fmt)
    assert ((buffer.double() - restored_buffer.double()).abs() <= bounds).all()
    restored = [torch.empty_like(t) for t in tensors]
    bound_of = [torch.empty_like(t, dtype=torch.float64) for t in tensors]
    bucket.unpack(restored_buffer, restored)
    bucket.unpack(bounds, bound_of)
    for original, back, bound in zip(tensors, restored, bound_of):
        assert ((original.double() - back.double()).abs() <= bound).all()


# ----- the two-stage reduce-scatter -----


def _rank_buffers(world: int, size: int, seed: int = 0) -> list[torch.Tensor]:
    """Each rank's rank-major buffer; segment ``d`` scaled by ``4**d``, so that a segment summed in the wrong place
    is off by far more than the bound."""
    torch.manual_seed(seed)
    scale = 4.0 ** torch.arange(world).repeat_interleave(size)
    return [torch.randn(world * size) * scale + scale / 2 for _ in range(world)]


def _simulate(buffers: list[torch.Tensor], plan: TwoStageReduce) -> tuple[list[torch.Tensor], list[bool]]:
    """What each rank ends with when the plan's steps run with all-to-alls done by indexing: rank ``(g, k)``
    receives row ``k`` of each group member's first payload, then row ``g`` of each ``(g', k)``'s second."""
    groups, size = plan.groups, plan.group_size
    first = [plan.quantize_intra(b) for b in buffers]
    assert all(q.payload.shape == (size, groups, plan.intra.layout(plan.segment_numel).nbytes) for q in first)
    assert all(q.payload.is_contiguous() for q in first)
    partials = [None] * len(buffers)
    for g in range(groups):
        for k in range(size):
            received = torch.stack([first[g * size + j].payload[k] for j in range(size)])
            partials[g * size + k] = plan.reduce_intra(received)
    second = [plan.quantize_inter(p) for p in partials]
    results = [None] * len(buffers)
    for g in range(groups):
        for k in range(size):
            received = torch.stack([second[h * size + k].payload[g] for h in range(groups)])
            results[g * size + k] = plan.reduce_inter(received)
    flags = [bool(a.nonfinite or b.nonfinite) for a, b in zip(first, second)]
    return results, flags


def _composed_bound(buffers: list[torch.Tensor], group_size: int, intra: BlockFormat, inter: BlockFormat):
    """Per rank, the bound on its reduced segment: each source block's error_bound, each partial block's (its absmax
    at most the sum of its sources' absmax plus their errors) and the fp32 sums' rounding (2**-24 per addition)."""
    world = len(buffers)
    size = buffers[0].numel() // world
    u = 2.0**-24
    bounds = []
    for d in range(world):
        sources = [_block_absmax(b.view(world, size)[d], intra.block_size) for b in buffers]
        errors = [error_bound(a, intra) for a in sources]
        group_bound, partial_sizes = 0.0, []
        for first in range(0, world, group_size):
            members = range(first, first + group_size)
            partial = sum(sources[r] + errors[r] for r in members)
            partial = _block_max(partial, inter.block_size)  # a partial block's absmax is at most its largest bound
            partial_sizes.append(partial)
            group_bound = group_bound + sum(errors[r] for r in members) + (group_size - 1) * u * partial
        inter_errors = [error_bound(a, inter) for a in partial_sizes]
        final_sum = sum(a + e for a, e in zip(partial_sizes, inter_errors))
        bounds.append(group_bound + sum(inter_errors) + (len(partial_sizes) - 1) * u * final_sum)
    return bounds


def _block_max(values: torch.Tensor, block: int) -> torch.Tensor:
    n = values.numel()
    padded = torch.nn.functional.pad(values, (0, -n % block)).view(-1, block)
    return padded.amax(-1).repeat_interleave(block)[:n]


TOPOLOGIES = [(2, 2), (1, 4), (4, 1), (3, 2)]  # (groups, group_size): 2 nodes x 2, 1 x 4, 4 x 1, 3 x 2


@pytest.mark.parametrize("groups,group_size", TOPOLOGIES)
@pytest.mark.parametrize("bits", [(4, 4), (8, 8), (4, 8)], ids=lambda b: f"int{b[0]}-int{b[1]}")
def test_two_stage_reduce_scatter_matches_the_reference_bitwise_and_the_exact_sum_within_the_bound(
    groups: int, group_size: int, bits: tuple[int, int]
) -> None:
    world, size = groups * group_size, 100  # not a multiple of the block: a partial last block per segment
    intra, inter = BlockFormat(bits[0], 64), BlockFormat(bits[1], 64)
    buffers = _rank_buffers(world, size, seed=world)
    reference = reference_two_stage_reduce_scatter(buffers, group_size, intra, inter)
    plan = TwoStageReduce(groups, group_size, size, intra, inter)
    results, flags = _simulate(buffers, plan)
    assert not any(flags)
    for rank in range(world):
        assert torch.equal(results[rank], reference[rank])
        assert results[rank].dtype == torch.float32 and results[rank].shape == (size,)
    exact = [sum(b.double().view(world, size)[d] for b in buffers) for d in range(world)]
    bounds = _composed_bound(buffers, group_size, intra, inter)
    for d in range(world):
        error = (reference[d].double() - exact[d]).abs()
        assert (error <= bounds[d]).all(), (d, (error - bounds[d]).max())
        assert error.max() > 0  # the quantization did happen


def test_reference_equals_the_exact_sum_when_every_value_is_a_code() -> None:
    # Values that are multiples of a power-of-two scale with the block's largest at ±qmax quantize exactly, and so
    # do their sums: the reference is then the plain sum, which a misplaced segment or a lost rank would break.
    world, size, fmt = 4, 64, BlockFormat(8, 64)
    buffers = []
    for r in range(world):
        codes = torch.randint(-127, 128, (world, size)).float()
        codes[:, 0] = 127.0
        buffers.append((codes * 2.0**-7).flatten())
    reference = reference_two_stage_reduce_scatter(buffers, 1, fmt, BlockFormat(8, 64))  # 4 groups of 1
    for d in range(world):
        assert torch.equal(reference[d], sum(b.view(world, size)[d] for b in buffers))


def test_intra_chunks_route_each_segment_to_the_member_with_its_index() -> None:
    plan = TwoStageReduce(groups=3, group_size=2, segment_numel=5)
    buffer = torch.arange(6).repeat_interleave(5).float()  # segment d holds d
    chunks = plan.intra_chunks(buffer)
    assert chunks.shape == (2, 3, 5)
    for j in range(2):
        for g in range(3):
            assert (chunks[j, g] == g * 2 + j).all()
    with pytest.raises(ValueError, match="buffer has 29 elements; expected world_size \\* segment_numel = 6 \\* 5"):
        plan.intra_chunks(buffer[:29])


def test_two_stage_bytes_on_the_wire() -> None:
    segment = 10000
    plan = TwoStageReduce(groups=2, group_size=4, segment_numel=segment)  # int4 both stages, block 4096
    payload = 3 * 4 + 5000  # 3 scales + 5000 code bytes (already aligned)
    assert plan.intra.layout(segment).nbytes == payload
    assert plan.intra_bytes == 3 * 2 * payload  # to 3 peers, 2 segments each
    assert plan.inter_bytes == 1 * payload  # to the 1 other group
    flat = (plan.world_size - 1) * segment * 4  # a flat fp32 reduce-scatter
    assert plan.inter_bytes / flat < 0.02 and (plan.intra_bytes + plan.inter_bytes) / flat < 0.16


def test_a_non_finite_gradient_reaches_the_flag_and_the_result() -> None:
    world, size, fmt = 4, 100, BlockFormat(4, 64)
    buffers = _rank_buffers(world, size)
    buffers[1][2 * size + 70] = math.nan  # rank 1's contribution to rank 2's segment, in its partial block
    plan = TwoStageReduce(2, 2, size, fmt, fmt)
    results, flags = _simulate(buffers, plan)
    assert flags[1]  # rank 1 quantized it: its flag is set, to be agreed on across ranks
    assert results[2][64:].isnan().all() and results[2][:64].isfinite().all()
    assert all(results[r].isfinite().all() for r in (0, 1, 3))


# ----- properties -----

FINITE_FP32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=150, **SETTINGS)
@given(
    values=st.lists(FINITE_FP32, max_size=80),
    scale_exponent=st.integers(-140, 120),
    block=st.sampled_from([2, 4, 6, 16, 64]),
    bits=st.sampled_from([8, 4]),
    dtype=st.sampled_from(DTYPES),
)
def test_property_every_element_within_the_bound(values, scale_exponent, block, bits, dtype) -> None:
    tensor = torch.tensor(values, dtype=torch.float64) * 2.0**scale_exponent
    info = torch.finfo(dtype)
    tensor = tensor.clamp(-info.max, info.max).to(dtype)
    _assert_within_bound(tensor, BlockFormat(bits, block))


@settings(max_examples=60, **SETTINGS)
@given(
    groups=st.integers(1, 3),
    group_size=st.integers(1, 3),
    size=st.integers(1, 40),
    block=st.sampled_from([2, 8, 16]),
    bits=st.sampled_from([(4, 4), (8, 8), (8, 4)]),
    seed=st.integers(0, 2**16),
)
def test_property_two_stage_matches_the_reference(groups, group_size, size, block, bits, seed) -> None:
    world = groups * group_size
    torch.manual_seed(seed)
    buffers = [torch.randn(world * size) * 10.0 ** torch.randint(-3, 4, (1,)).item() for _ in range(world)]
    intra, inter = BlockFormat(bits[0], block), BlockFormat(bits[1], block)
    reference = reference_two_stage_reduce_scatter(buffers, group_size, intra, inter)
    results, _ = _simulate(buffers, TwoStageReduce(groups, group_size, size, intra, inter))
    bounds = _composed_bound(buffers, group_size, intra, inter)
    for d in range(world):
        assert torch.equal(results[d], reference[d])
        exact = sum(b.double().view(world, size)[d] for b in buffers)
        assert ((reference[d].double() - exact).abs() <= bounds[d]).all()


@pytest.mark.parametrize("groups,group_size", [(2, 2), (3, 2)])
def test_two_stage_parts_restart_the_blocks_at_each_part(groups: int, group_size: int) -> None:
    """A segment of parts (a bucket's parameters) reduces as if each part were reduced on its own, bit for bit, and
    its payload is the parts' payloads end to end; a part of small values next to large ones keeps its own scale."""
    world, parts, fmt = groups * group_size, (70, 0, 1, 29), BlockFormat(4, 64)
    size = sum(parts)
    buffers = _rank_buffers(world, size, seed=7)
    for b in buffers:
        b.view(world, size)[:, 71:] *= 1e-6  # the last part: a millionth of the first
    plan = TwoStageReduce(groups, group_size, size, fmt, fmt, parts=parts)
    assert plan.payload_bytes(fmt) == sum(fmt.layout(p).nbytes for p in parts) == 44 + 0 + 8 + 20  # 2 scales + 35 code bytes, rounded up; 1 scale + 1; 1 + 15
    results, flags = _simulate_parts(buffers, plan)
    assert not any(flags)
    start = 0
    for part in parts:
        rows = [b.view(world, size)[:, start : start + part].reshape(-1) for b in buffers]
        reference = reference_two_stage_reduce_scatter(rows, group_size, fmt)
        for rank in range(world):
            assert torch.equal(results[rank][start : start + part], reference[rank])
        start += part
    whole = reference_two_stage_reduce_scatter(buffers, group_size, fmt)
    assert all(not whole[r][71:].any() for r in range(world))  # one scale for all: the small part rounds to zero
    assert all((results[r][71:] != 0).float().mean() > 0.5 for r in range(world))  # its own scale: most kept
    with pytest.raises(ValueError, match=r"TwoStageReduce.parts=\(1, 2\) must be sizes >= 0 adding up to "):
        TwoStageReduce(2, 2, 4, parts=(1, 2))


def _simulate_parts(buffers, plan):
    """``_simulate`` for a plan whose payload is ``plan.payload_bytes`` wide."""
    groups, size = plan.groups, plan.group_size
    first = [plan.quantize_intra(b) for b in buffers]
    assert all(q.payload.shape == (size, groups, plan.payload_bytes(plan.intra)) for q in first)
    partials = [None] * len(buffers)
    for g in range(groups):
        for k in range(size):
            partials[g * size + k] = plan.reduce_intra(torch.stack([first[g * size + j].payload[k] for j in range(size)]))
    second = [plan.quantize_inter(p) for p in partials]
    results = [None] * len(buffers)
    for g in range(groups):
        for k in range(size):
            results[g * size + k] = plan.reduce_inter(torch.stack([second[h * size + k].payload[g] for h in range(groups)]))
    return results, [bool(a.nonfinite or b.nonfinite) for a, b in zip(first, second)]
