"""Partition bookkeeping with no processes: shard ranges, padding, flat layouts, buckets."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.sharding.buckets import Bucket, make_buckets
from lightning_zero.sharding.flat_param import ShardSpec, shard_parameters


def _bucket(tensors, rank: int, world: int) -> Bucket:
    """A bucket over parameters of the tensors' shapes, as rank ``rank`` of ``world`` sees it."""
    params = [(f"p{i}", torch.nn.Parameter(t.clone())) for i, t in enumerate(tensors)]
    return Bucket(shard_parameters(params, rank, world))


def _specs(bucket: Bucket) -> list[ShardSpec]:
    return [s.spec for s in bucket.shards]


@pytest.mark.parametrize("rows,world", [(8, 2), (8, 4), (11, 4), (7, 2), (3, 4), (1, 4), (5, 8)])
def test_owned_rows_cover_every_row_once_and_are_balanced(rows: int, world: int) -> None:
    spec = ShardSpec(torch.Size((rows, 3)), 0, world)
    ranges = [spec.owned_rows(r) for r in range(world)]
    covered = [row for lo, hi in ranges for row in range(lo, hi)]
    assert covered == list(range(rows))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) == -(-rows // world)  # ceil
    assert spec.padded_numel * world - spec.numel == (spec.rows_per_rank * world - rows) * 3  # padding < world rows
    assert spec.rows_per_rank * world - rows < world


def test_more_ranks_than_rows_leaves_empty_shards() -> None:
    specs = [ShardSpec(torch.Size((3, 2)), r, 8) for r in range(8)]
    assert [s.local_rows for s in specs] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert specs[5].local_shape == torch.Size((0, 2))
    assert specs[5].local_view(torch.ones(3, 2)).numel() == 0


def test_zero_dim_parameter_is_one_row() -> None:
    assert ShardSpec(torch.Size(()), 0, 4).local_shape == torch.Size((1,))
    assert ShardSpec(torch.Size(()), 2, 4).local_shape == torch.Size((0,))


def test_local_view_shares_storage_with_the_full_tensor() -> None:
    full = torch.arange(20.0).view(5, 4)
    spec = ShardSpec(full.shape, 1, 2)  # rows 3..4 of 5
    view = spec.local_view(full)
    assert view.tolist() == [[12.0, 13.0, 14.0, 15.0], [16.0, 17.0, 18.0, 19.0]]
    view.mul_(-1)
    assert full[3, 0] == -12.0


def test_pack_is_rank_major_with_zero_padding() -> None:
    a = torch.arange(1.0, 6.0)  # 5 rows over 2 ranks: 3 + 2, one padded row
    b = torch.arange(10.0, 14.0).view(2, 2)  # 2 rows: 1 + 1
    layout = _bucket([a, b], 0, 2)
    assert layout.segment_numel == 3 + 2 and layout.full_numel == 10
    out = torch.full((10,), float("nan"))
    layout.pack([a, b], out)
    assert out.tolist() == [1, 2, 3, 10, 11, 4, 5, 0, 12, 13]


def test_pack_none_is_zeros_and_unpack_inverts_pack() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in [(7, 3), (2,), (), (4, 4), (1, 5)]]
    for world in (1, 2, 3, 4, 8):
        layout = _bucket(tensors, 0, world)
        buffer = torch.empty(layout.full_numel)
        layout.pack(tensors, buffer)
        restored = [torch.zeros_like(t) for t in tensors]
        layout.unpack(buffer, restored)
        for t, r in zip(tensors, restored):
            assert torch.equal(t, r)
        assert buffer.sum() == pytest.approx(sum(t.sum() for t in tensors).item(), rel=1e-5)
    layout = _bucket([torch.ones(3)], 0, 2)
    buffer = torch.ones(4)
    layout.pack([None], buffer)
    assert buffer.tolist() == [0, 0, 0, 0]


def test_each_rank_segment_holds_its_own_rows() -> None:
    tensors = [torch.arange(30.0).view(10, 3), torch.arange(7.0)]
    for rank in range(4):
        layout = _bucket(tensors, rank, 4)
        buffer = torch.empty(layout.full_numel)
        layout.pack(tensors, buffer)
        segment = buffer.view(4, -1)[rank]
        for spec, local in zip(_specs(layout), layout.local_views(segment)):
            full = tensors[_specs(layout).index(spec)]
            assert torch.equal(local, spec.local_view(full))


def test_pack_local_then_unpack_rebuilds_from_every_rank() -> None:
    tensors = [torch.randn(9, 2), torch.randn(3)]
    world = 4
    buffer = torch.empty(_bucket(tensors, 0, world).full_numel)
    for rank in range(world):
        layout = _bucket(tensors, rank, world)
        layout.pack_local([s.local_view(t) for s, t in zip(_specs(layout), tensors)], buffer.view(world, -1)[rank])
    rebuilt = [torch.zeros_like(t) for t in tensors]
    layout.unpack(buffer, rebuilt)
    assert all(torch.equal(a, b) for a, b in zip(tensors, rebuilt))


def test_buckets_respect_the_cap_and_dtype() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    module[2].double()
    shards = shard_parameters(module.named_parameters(), 0, 2)
    buckets = make_buckets(shards, bucket_bytes=64 * 64 * 4 + 64 * 4)
    sizes = [[s.name for s in b.shards] for b in buckets]
    assert sizes == [["0.weight", "0.bias"], ["1.weight", "1.bias"], ["2.weight", "2.bias"]]
    huge = make_buckets(shards, bucket_bytes=1)
    assert len(huge) == len(shards)  # a parameter over the cap gets a bucket of its own


def test_large_evenly_split_parameters_get_buckets_of_their_own() -> None:
    module = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 63), torch.nn.Linear(63, 6)
    )
    shards = shard_parameters(module.named_parameters(), 0, 4)
    buckets = make_buckets(shards, bucket_bytes=2**20, alone_bytes=64 * 60 * 4)
    names = [[s.name for s in b.shards] for b in buckets]
    # Only 0.weight is large and splits evenly (64 rows on 4 ranks); 2.weight is as large but its 63 rows need
    # padding, so it is packed. The packed bucket stays open across the one alone: small parameters travel together.
    assert names == [["0.weight"], ["0.bias", "1.weight", "1.bias", "2.weight", "2.bias", "3.weight", "3.bias"]]
    alone, packed = buckets
    weight = module[0].weight
    own = alone.own_buffer([weight])
    assert own is not None and own.data_ptr() == weight.data_ptr() and own.numel() == alone.full_numel
    assert packed.own_buffer([p for p in module.parameters()][1:]) is None
    assert alone.own_buffer([weight.detach().t()]) is None  # not contiguous: packed through a buffer
    assert alone.own_buffer([weight.detach().double()]) is None  # another dtype (a reduction in fp32)
    # Packing into and unpacking from the tensor itself change nothing; its rank-major segments are its rows.
    before = weight.detach().clone()
    alone.pack([weight.detach()], own)
    alone.unpack(own, [weight.detach()])
    assert torch.equal(weight.detach(), before)
    assert torch.equal(alone.segment(own, 2), before[32:48].reshape(-1))
    assert len(make_buckets(shards, bucket_bytes=2**20)) == 1  # without alone_bytes everything is packed
    # Reduced in another dtype, a gradient always needs a buffer: a bucket of its own would only add collectives.
    assert len(make_buckets(shards, bucket_bytes=2**20, dtype=torch.float64, alone_bytes=1)) == 1


def test_shards_of_frozen_parameters_are_frozen_views() -> None:
    module = torch.nn.Linear(6, 4)
    module.bias.requires_grad_(False)
    weight, bias = shard_parameters(module.named_parameters(), 1, 2)
    assert weight.trainable and weight.local.shape == (2, 6)
    assert not bias.trainable
    assert weight.local.data_ptr() == module.weight[2:].data_ptr()


@pytest.mark.parametrize("piece", [None, 7])
@pytest.mark.parametrize("kept_dtype,param_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_adopting_edits_takes_exactly_the_changed_elements(monkeypatch, piece, kept_dtype, param_dtype) -> None:
    # The step's check of user writes (ParamShard.adopt_edits, mixed precision): an element the parameter holds as
    # the runtime wrote it keeps the master's value (its fp32 precision); a changed one takes the parameter's. Done
    # in pieces of _ADOPT_PIECE elements, in place; a wider parameter than the destination is narrowed.
    from lightning_zero.sharding import flat_param

    if piece is not None:
        monkeypatch.setattr(flat_param, "_ADOPT_PIECE", piece)
    kept = torch.randn(6, 5, dtype=torch.float64).to(kept_dtype)
    before = kept.clone()
    rows = kept.to(param_dtype)
    rows[1, 2], rows[4, 0] = 3.0, -2.0
    storage = kept.data_ptr()
    flat_param._adopt_changed_elements(kept, rows)
    want = before.clone()
    want[1, 2], want[4, 0] = 3.0, -2.0
    assert torch.equal(kept, want) and kept.data_ptr() == storage
