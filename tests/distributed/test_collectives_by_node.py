"""gloo's all-gathers and reduce-scatters over several nodes of several ranks run node by node (collectives.py,
[Note: hierarchical collectives]): on 4 ranks as 2 nodes x 2, 6 as 3 x 2 and 6 as 2 x 3, several of each in flight
at once (their messages must not pair up across collectives, whichever thread issues them), every gathered buffer
exactly every rank's rows, every reduced shard the mean over the world of the gradients' rows, the bytes across
nodes one segment per rank and call; and under hybrid sharding the replica all-reduce issued by the relay thread
gives the world's mean too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.sharding.collectives import Collectives, CommStats, topology_collectives
from lightning_zero.sharding.buckets import Bucket
from lightning_zero.sharding.flat_param import shard_parameters
from lightning_zero.sharding.topology import Topology
from tests.harness import run_on_ranks

SHAPES = [(7, 3), (5,), (11, 2), (1,)]
IN_FLIGHT = 3


def _full(i: int) -> list[torch.Tensor]:
    """The parameters every rank holds in round ``i``."""
    g = torch.Generator().manual_seed(100 + i)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def _grads(i: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s gradients in round ``i``."""
    g = torch.Generator().manual_seed(1000 * i + rank)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def _bucket(rank: int, world: int, i: int = 0) -> Bucket:
    params = [(f"p{j}", nn.Parameter(t)) for j, t in enumerate(_full(i))]
    return Bucket(shard_parameters(params, rank, world))


def _flat(rank: int, world: int, node: int) -> dict:
    comms = Collectives(torch.device("cpu"), node_size=node)
    buckets = [_bucket(rank, world, i) for i in range(IN_FLIGHT)]
    # Reductions and gathers interleaved, all issued before any is waited; waited in another order.
    issued = []
    for i, bucket in enumerate(buckets):
        issued.append(comms.reduce_scatter(bucket, _grads(i, rank)))
        issued.append(comms.all_gather(bucket, [s.local for s in bucket.shards]))
    done = [issued[k].wait() for k in reversed(range(len(issued)))][::-1]
    reduced = [[v.clone() for v in views] for views in done[0::2]]
    gathered = [buffer.clone() for buffer in done[1::2]]
    comms.close()
    stats = {op: (s.calls, s.bytes, s.wire_bytes, s.cross_bytes) for op, s in comms.stats.by_op.items()}
    return dict(grid=comms.by_node, reduced=reduced, gathered=gathered, stats=stats,
                segment=buckets[0].segment_numel)


@pytest.mark.parametrize(("world", "node"), [(4, 2), (6, 2), (6, 3)])
def test_gathers_and_reductions_node_by_node(world: int, node: int) -> None:
    out = run_on_ranks(lambda rank, w: _flat(rank, w, node), world)
    nodes = world // node
    for rank, got in enumerate(out):
        assert got["grid"] == (nodes, node)
        for i in range(IN_FLIGHT):
            expected = _bucket(rank, world, i)
            full = expected.empty()
            expected.pack(_full(i), full)
            assert torch.equal(got["gathered"][i], full), (rank, i)
            mean = [sum(g) / world for g in zip(*(_grads(i, r) for r in range(world)))]
            reference = _bucket(rank, world, i)
            buffer = reference.empty()
            reference.pack(mean, buffer)
            for view, want in zip(got["reduced"][i], reference.local_views(reference.segment(buffer))):
                torch.testing.assert_close(view, want, rtol=1e-6, atol=1e-7)
        # Per call (logical and wire bytes alike): (N-1)/N of the buffer; across nodes one segment per other node.
        segment = 4 * got["segment"]
        logical = segment * (world - 1)
        for op in ("reduce_scatter", "all_gather"):
            assert got["stats"][op] == (IN_FLIGHT, IN_FLIGHT * logical, IN_FLIGHT * logical,
                                        IN_FLIGHT * (nodes - 1) * segment), (rank, op)


def _hybrid(rank: int, world: int) -> dict:
    topology = Topology.make(world, rank, 2, None, host_ranks=world)
    comms = topology_collectives(torch.device("cpu"), topology, True, CommStats())
    buckets = [_bucket(topology.shard_rank, 2, i) for i in range(IN_FLIGHT)]
    issued = [comms.reduce_scatter(bucket, _grads(i, rank)) for i, bucket in enumerate(buckets)]
    reduced = [[v.clone() for v in r.wait()] for r in reversed(issued)][::-1]
    comms.close()
    return dict(reduced=reduced, all_reduce=comms.stats.by_op["all_reduce"].calls)


def test_the_replica_all_reduce_issued_by_the_relay_thread_gives_the_worlds_mean() -> None:
    out = run_on_ranks(_hybrid, 4)
    for rank, got in enumerate(out):
        assert got["all_reduce"] == IN_FLIGHT
        for i in range(IN_FLIGHT):
            mean = [sum(g) / 4 for g in zip(*(_grads(i, r) for r in range(4)))]
            reference = _bucket(rank % 2, 2, i)
            buffer = reference.empty()
            reference.pack(mean, buffer)
            for view, want in zip(got["reduced"][i], reference.local_views(reference.segment(buffer))):
                torch.testing.assert_close(view, want, rtol=1e-6, atol=1e-7)
