"""The topology of hybrid sharding (which ranks shard together, which replicate, which share a node) and the model of
what each collective algorithm sends across nodes (sharding/topology.py), without processes."""

from __future__ import annotations

import pytest

from lightning_zero import ZeroConfigError
from lightning_zero.sharding.topology import Links, Topology, launched_node_size


def test_consecutive_shard_groups_and_strided_replica_groups() -> None:
    topology = Topology.make(world_size=8, rank=5, shard_group_size=4, node_size=None, host_ranks=8)
    assert topology.shard_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topology.replica_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (topology.shard_rank, topology.replica_rank, topology.replicas) == (1, 1, 2)
    assert topology.hybrid and topology.node_size == 4  # a node is the shard group unless given


def test_flat_sharding_takes_the_node_from_the_hosts_ranks() -> None:
    flat = Topology.make(world_size=8, rank=3, shard_group_size=None, node_size=None, host_ranks=4)
    assert not flat.hybrid and flat.shard_group_size == 8 and flat.node_size == 4
    assert flat.shard_groups() == [list(range(8))] and flat.replica_groups() == [[r] for r in range(8)]
    assert Topology.make(4, 0, None, 2, host_ranks=4).node_size == 2  # 4 CPU ranks as 2 nodes x 2


@pytest.mark.parametrize(("options", "message"), [
    (dict(shard_group_size=4, node_size=None), "shard_group_size=4 is invalid for a world of 6 ranks: it must divide "
                                               "the world size (allowed: 1, 2, 3, 6)"),
    (dict(shard_group_size=3, node_size=4), "node_size=4 is invalid for a world of 6 ranks: it must divide the world "
                                            "size (allowed: 1, 2, 3, 6)"),
])
def test_a_size_that_does_not_divide_the_world_is_refused(options: dict, message: str) -> None:
    with pytest.raises(ZeroConfigError) as err:
        Topology.make(6, 0, host_ranks=6, **options)
    assert str(err.value) == message


def test_three_groups_of_two() -> None:
    topology = Topology.make(6, 4, shard_group_size=2, node_size=None, host_ranks=6)
    assert topology.shard_groups() == [[0, 1], [2, 3], [4, 5]]
    assert topology.replica_groups() == [[0, 2, 4], [1, 3, 5]]
    assert (topology.shard_rank, topology.replica_rank) == (0, 2)


def test_hpz_groups_are_consecutive_ranks_inside_the_shard_group() -> None:
    flat = Topology.make(8, 5, shard_group_size=None, node_size=None, host_ranks=8, hpz_group_size=2)
    assert flat.hpz_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]] and flat.hpz_group == 2
    assert flat.node_size == 2 and flat.needs_groups and not flat.hybrid  # a node is the hpZ group unless given
    hybrid = Topology.make(8, 6, shard_group_size=4, node_size=None, host_ranks=8, hpz_group_size=2)
    assert hybrid.hpz_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]] and hybrid.node_size == 4
    assert not Topology.make(8, 0, None, None, host_ranks=8).needs_groups


@pytest.mark.parametrize(("group", "hpz", "allowed"), [(None, 4, "1, 2, 3"), (None, 6, "1, 2, 3"), (2, 2, "1"),
                                                        (1, 1, "none")])
def test_an_hpz_group_that_does_not_fit_the_shard_group_is_refused(group, hpz: int, allowed: str) -> None:
    with pytest.raises(ZeroConfigError) as err:
        Topology.make(6, 0, shard_group_size=group, node_size=None, host_ranks=6, hpz_group_size=hpz)
    size = group or 6
    assert str(err.value) == (f"hpz_group_size={hpz} is invalid for a shard group of {size} ranks (world 6): it must "
                              f"divide the shard group size and be smaller (allowed: {allowed})")


def test_ring_crosses_only_where_the_next_member_is_on_another_node() -> None:
    world = (0, 1, 2, 3)
    assert [Links(world, i, node_size=2).ring(100.0) for i in range(4)] == [0.0, 100.0, 0.0, 100.0]
    assert Links((0, 2), 0, node_size=2).ring(100.0) == 100.0  # a replica group: its members on two nodes
    assert Links((0, 1), 1, node_size=2).ring(100.0) == 0.0  # a shard group inside one node
    assert Links(world, 1, node_size=None).ring(100.0) == 0.0  # one node


def test_direct_sends_cross_once_per_member_on_another_node() -> None:
    assert [Links((0, 1, 2, 3), i, node_size=2).to_each(10.0) for i in range(4)] == [20.0] * 4
    # A wrong grouping (strided, across the nodes) would make the shard group's traffic cross.
    assert Links((0, 2), 0, node_size=2).to_each(10.0) == 10.0


def test_broadcast_down_gloos_tree_or_along_a_chain() -> None:
    world = (0, 1, 2, 3)
    # gloo's binomial tree from 0: 0 -> 1, then 0 -> 2 and 1 -> 3; 0 -> 2 and 1 -> 3 cross.
    assert [Links(world, i, 2).broadcast(8.0, root=0, chain=False) for i in range(4)] == [8.0, 8.0, 0.0, 0.0]
    # From 1, counted from it (1, 2, 3, 0): 1 -> 2, then 1 -> 3 and 2 -> 0: all three cross.
    assert [Links(world, i, 2).broadcast(8.0, root=1, chain=False) for i in range(4)] == [0.0, 16.0, 8.0, 0.0]
    # 6 members from 0: 0 -> 1, 0 -> 2, 1 -> 3, 0 -> 4, 1 -> 5 (nodes of 3: 0-2 | 3-5).
    six = (0, 1, 2, 3, 4, 5)
    assert [Links(six, i, 3).broadcast(1.0, root=0, chain=False) for i in range(6)] == [1.0, 2.0, 0.0, 0.0, 0.0, 0.0]
    # An all-gather, one broadcast per member's row: rows sent across by each rank (2 x 2: 2 from even ranks, 3 from
    # odd ones; 3 nodes x 2: 4 and 5 of the 5 rows).
    assert [Links(world, i, 2).tree_gather_rows for i in range(4)] == [2, 3, 2, 3]
    assert [Links(six, i, 2).tree_gather_rows for i in range(6)] == [4, 5, 4, 5, 4, 5]
    # NCCL's chain 0 -> 1 -> 2 -> 3: only 1 -> 2 crosses; 3 does not send back to the root.
    assert [Links(world, i, 2).broadcast(8.0, root=0, chain=True) for i in range(4)] == [0.0, 8.0, 0.0, 0.0]


def test_one_group_per_node_is_the_launchers_node() -> None:
    # torchrun: 2 nodes x 4 ranks; "node" is the launcher's 4, whatever the emulation defaults would be.
    hybrid = Topology.make(8, 5, shard_group_size="node", node_size=None, host_ranks=4, hpz_group_size=2)
    assert (hybrid.shard_group_size, hybrid.node_size, hybrid.hpz_group_size) == (4, 4, 2)
    assert hybrid.shard_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    flat = Topology.make(8, 5, shard_group_size=None, node_size=None, host_ranks=4, hpz_group_size="node")
    assert (flat.shard_group_size, flat.node_size, flat.hpz_group_size) == (8, 4, 4)
    # Shard groups smaller than a node: the node is still the launcher's.
    assert Topology.make(8, 0, shard_group_size=2, node_size=None, host_ranks=4).node_size == 4
    # One node emulating two (4 CPU ranks as 2 x 2): node_size says where they split, "node" follows it.
    assert Topology.make(4, 0, "node", node_size=2, host_ranks=4).shard_group_size == 2


def test_a_node_size_that_contradicts_the_launcher_is_refused() -> None:
    with pytest.raises(ZeroConfigError) as err:
        Topology.make(8, 0, shard_group_size=None, node_size=8, host_ranks=4)
    assert str(err.value) == ("node_size=8 disagrees with the launcher, which started 2 nodes of 4 ranks: drop node_size "
                              "(the nodes are read from the launcher)")


def test_an_hpz_group_of_the_whole_node_under_one_group_per_node_is_refused() -> None:
    with pytest.raises(ZeroConfigError) as err:
        Topology.make(8, 0, shard_group_size=4, node_size=None, host_ranks=4, hpz_group_size="node")
    assert str(err.value) == ("hpz_group_size='node' (4 ranks a node) is invalid for a shard group of 4 ranks (world 8): "
                              "it must divide the shard group size and be smaller (allowed: 1, 2)")


@pytest.mark.parametrize(("environ", "external", "expected"), [
    ({"LOCAL_WORLD_SIZE": "2"}, True, 2),  # torchrun
    ({"SLURM_NTASKS_PER_NODE": "2"}, True, 2),  # srun --ntasks-per-node=2
    ({"LOCAL_WORLD_SIZE": "2"}, False, 4),  # Lightning started the processes: its devices, whatever is left over
    ({}, True, 4),  # a launcher that says nothing: the Trainer's devices
])
def test_the_node_size_is_the_launchers(environ: dict, external: bool, expected: int) -> None:
    devices, num_nodes = expected, 4 // expected
    assert launched_node_size(environ, external, devices, num_nodes, world_size=4) == expected


def test_a_trainer_that_contradicts_the_launchers_nodes_is_refused_in_one_line() -> None:
    # The case: torchrun --nnodes 2 --nproc-per-node 2 and Trainer(devices=4, num_nodes=1), which
    # Lightning's own check (devices * num_nodes == world size) lets through.
    with pytest.raises(ZeroConfigError) as err:
        launched_node_size({"LOCAL_WORLD_SIZE": "2"}, True, devices=4, num_nodes=1, world_size=4)
    assert str(err.value) == (
        "the launcher started 2 nodes of 2 ranks (LOCAL_WORLD_SIZE=2, world size 4), but the Trainer has num_nodes=1 "
        "and devices=4: set Trainer(num_nodes=2, devices=2) to match the launch"
    )
    with pytest.raises(ZeroConfigError, match=r"the launcher started a ragged layout \(LOCAL_WORLD_SIZE=3, world size 4"):
        launched_node_size({"LOCAL_WORLD_SIZE": "3"}, True, devices=1, num_nodes=4, world_size=4)


@pytest.mark.parametrize(("members", "node_size", "grid"), [
    ((0, 1, 2, 3), 2, (2, 2)),  # 2 nodes x 2: node by node
    (tuple(range(6)), 3, (2, 3)),
    ((0, 1, 4, 5), 2, (2, 2)),  # a subgroup of whole nodes
    ((0, 1, 2, 3), 4, None),  # one node: nothing to save
    ((0, 1, 2, 3), 1, None),  # a rank a node: each rank's row crosses anyway
    ((0, 2, 1, 3), 2, None),  # not node by node in group order
    ((0, 1, 2), 2, None),  # a partial node
])
def test_a_group_of_whole_nodes_is_a_grid(members, node_size: int, grid) -> None:
    assert Links(members, 0, node_size).grid == grid
