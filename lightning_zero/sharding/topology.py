"""Which ranks shard the model states together, which hold replicas of one another, and which share a host: the
topology of (hybrid) sharding, as arithmetic on ranks. Nothing here calls ``torch.distributed``: collectives.py makes
the process groups from a ``Topology`` (``topology_collectives``), and counts what crosses hosts with ``Links``.

[Note: hybrid sharding]
With ``shard_group_size=K`` the ``N`` ranks form ``R = N / K`` consecutive groups of ``K`` (ranks ``gK .. gK+K-1``,
the "shard group", typically one host): parameters, gradients and optimizer states are sharded within the group, as
flat sharding shards them over the world, and each group holds a full replica of the model states. Rank ``r`` is at
position ``r % K`` of its shard group and in replica ``r // K``; the ranks at one position across the groups form its
"replica group" (``p, p+K, p+2K, ...``), which hold the same rows. A step: the gradients are reduce-scattered inside
the shard group (each rank pre-divides by ``N``, as DDP does), then each rank's reduced shard is all-reduced (summed)
across its replica group, which gives exactly the mean over all ``N`` ranks that DDP computes; the parameter
all-gathers (stages 1-2 after the update, stage 3 around each unit) run inside the shard group only. Every quantity
that sums over shards (the gradient norm, the non-finite check, ``grad_norm``) is summed over the shard group only:
its replicas hold the same values, so summing over the world would count each one ``R`` times. What must agree
across every rank (rank 0's module states and buffers, the unused-parameter flags, the random state of meta-device
init, checkpoint coordination) still goes over the world. ``K = N`` is flat sharding; ``K = 1`` replicates every
state on every rank and all-reduces the gradients, as DDP does.

A checkpoint holds each row once: the ranks of replica 0 (ranks ``0 .. K-1``) write their shards, the other replicas
write nothing, and the file records ``K`` writers; rows are found by ``ShardSpec`` at load, so it loads at any
world size and ``shard_group_size`` (and flat).

[Note: what crosses nodes]
A node is ``node_size`` consecutive ranks (one host). ``CommStats.cross_group_bytes`` counts the bytes this rank
*sends* to ranks of another node, from the members of each collective's group (global ranks, in group order) and the
algorithm that runs it; ``Links`` holds the per-algorithm models:

- ring (NCCL's reduce-scatter, all-gather and all-reduce, gloo's all-reduce): the group's ranks form a ring in group
  order and a rank sends everything it sends to the next member: ``(n-1)/n`` of the buffer for a reduce-scatter or
  an all-gather, ``2(n-1)/n`` for an all-reduce. All of it crosses if that member is on another node, none otherwise.
- direct (the exchange gloo's reduce-scatter runs within a node, or with a rank a node): a rank sends its segment
  (``1/n`` of the buffer) straight to each other member; it crosses for each member on another node.
- node by node (gloo's all-gather and reduce-scatter over whole nodes of several ranks, ``Links.grid``; see
  [Note: hierarchical collectives] in by_node.py): a rank sends one segment (``1/n`` of the buffer) to the rank
  at its position on each other node, and nothing else across.
- broadcast: on gloo a binomial tree (gloo/broadcast.cc): counted from the root, member ``v`` sends the tensor to
  ``v + 2**i`` for every ``2**i > v`` inside the group; gloo's all-gather elsewhere is one such broadcast per rank's
  row. On NCCL a chain in group order from the root, each member but the last forwarding it to the next.

At 2 nodes x 2 ranks (node_size 2), flat ZeRO-3 on gloo sends one segment across per reduce-scatter and per all-gather
(a quarter of the buffer; checked against the sockets by benchmarks/zeropp.py and the link by
tests/integration/test_emulated_nodes.py): per step ``b * (3 S_units + 2 S_root)`` with ``S`` the elements of a
rank's segment (``S = Psi/4`` padded, the root unit gathered once a step). With ``shard_group_size=2`` nothing of
the shard group crosses, only the replica all-reduce of the gradient shard (a ring of 2: the whole segment, ``Psi/2``
padded, to the other node): ``b * Psi/2``. With ``hpz_group_size=2`` (flat), the units' backward gathers run inside
each node (unit_state.py, [Note: hpZ's secondary shards]): ``b * (2 S_units + 2 S_root)``. Small all-reduces (norm,
flags) are counted too, by the ring model.

[Note: nodes from the launcher]
Which ranks share a node is the launcher's to say: torchrun gives each rank ``LOCAL_WORLD_SIZE``, SLURM
``SLURM_NTASKS_PER_NODE``; where Lightning starts the processes itself, a node runs the Trainer's ``devices``. A
launcher's node size is checked against the Trainer: ``WORLD_SIZE / LOCAL_WORLD_SIZE`` nodes must be its
``num_nodes``, else setup fails on every rank with one error naming both (Lightning's own check, ``devices *
num_nodes`` equal to the world size, lets ``Trainer(devices=4, num_nodes=1)`` under a torchrun of 2 nodes x 2
through, and the nodes would then silently be taken for one: qgZ's stages, ``cross_group_bytes`` and
``shard_group_size="node"`` all wrong). ``shard_group_size="node"`` and ``hpz_group_size="node"`` name that size.

Tests and benchmarks emulate several nodes on one host (4 CPU ranks as 2 nodes x 2); there the launcher started one
node, and ``node_size`` (or, without it, the shard group or hpZ group size) says where the emulated nodes split. A
``node_size`` given under a launcher of several nodes must agree with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from lightning_zero.config import PER_NODE, ZeroConfigError

#: Where launchers give the ranks they started on each node: torchrun (and its elastic agents), SLURM with
#: ``--ntasks-per-node``.
LAUNCHER_VARIABLES = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks in consecutive shard groups of ``shard_group_size``, nodes of ``node_size``; seen from
    ``rank`` (see [Note: hybrid sharding])."""

    world_size: int
    rank: int
    shard_group_size: int
    node_size: int
    #: hpZ: consecutive ranks sharing the secondary shards of the units' weights (``None``: off; see [Note: hpZ's
    #: secondary shards] in unit_state.py).
    hpz_group_size: int | None = None

    @classmethod
    def make(cls, world_size: int, rank: int, shard_group_size: int | str | None, node_size: int | None,
             host_ranks: int, hpz_group_size: int | str | None = None) -> Topology:
        """From the options (``None``: flat sharding; ``"node"``: one group per node) and ``host_ranks``, the ranks
        the launcher started on each node (``launched_node_size``). The node size (see [Note: nodes from the
        launcher]): ``node_size`` if given, else ``host_ranks`` when the launcher started several nodes, else (one
        node, emulating several) ``shard_group_size``, ``hpz_group_size`` or ``host_ranks``, the first given as a
        number. Raises, naming the option, unless each divides the world size, ``hpz_group_size`` divides the shard
        group size and is smaller, and a ``node_size`` given agrees with a launcher that started several nodes."""
        node_size = _node_size(world_size, node_size, host_ranks, shard_group_size, hpz_group_size)
        group = _per_node(shard_group_size, node_size)
        group = world_size if group is None else group
        _check_divides("shard_group_size", group, world_size)
        hpz = _per_node(hpz_group_size, node_size)
        if hpz is not None and (hpz >= group or group % hpz):
            allowed = ", ".join(str(d) for d in range(1, group) if group % d == 0) or "none"
            given = f"{hpz_group_size!r} ({hpz} ranks a node)" if hpz_group_size == PER_NODE else str(hpz)
            raise ZeroConfigError(
                f"hpz_group_size={given} is invalid for a shard group of {group} ranks (world {world_size}): "
                f"it must divide the shard group size and be smaller (allowed: {allowed})"
            )
        return cls(world_size, rank, group, node_size, hpz)

    @property
    def needs_groups(self) -> bool:
        """Whether process groups other than the world are needed (hybrid sharding, hpZ)."""
        return self.hybrid or self.hpz_group_size is not None

    @property
    def hybrid(self) -> bool:
        """Whether there is more than one replica of the shards."""
        return self.shard_group_size < self.world_size

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_group_size

    @property
    def shard_rank(self) -> int:
        """This rank's position in its shard group: which rows it owns."""
        return self.rank % self.shard_group_size

    @property
    def replica_rank(self) -> int:
        """Which replica (shard group) this rank belongs to."""
        return self.rank // self.shard_group_size

    def shard_groups(self) -> list[list[int]]:
        k = self.shard_group_size
        return [list(range(g * k, (g + 1) * k)) for g in range(self.replicas)]

    def replica_groups(self) -> list[list[int]]:
        k = self.shard_group_size
        return [list(range(p, self.world_size, k)) for p in range(k)]

    def hpz_groups(self) -> list[list[int]]:
        """hpZ's groups: consecutive ranks, each group inside one shard group (``hpz_group_size`` divides it)."""
        k = self.hpz_group_size
        return [list(range(g * k, (g + 1) * k)) for g in range(self.world_size // k)] if k is not None else []

    @property
    def hpz_group(self) -> int:
        """Which of ``hpz_groups`` this rank belongs to."""
        return self.rank // self.hpz_group_size


def _check_divides(name: str, value: int, world_size: int) -> None:
    if value < 1 or world_size % value:
        allowed = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise ZeroConfigError(
            f"{name}={value} is invalid for a world of {world_size} ranks: it must divide the world size "
            f"(allowed: {allowed})"
        )


def _node_size(world_size: int, node_size: int | None, host_ranks: int, *groups: int | str | None) -> int:
    """The ranks of a node (see [Note: nodes from the launcher])."""
    several = host_ranks < world_size
    if node_size is not None:
        if several and node_size != host_ranks:
            raise ZeroConfigError(
                f"node_size={node_size} disagrees with the launcher, which started {world_size // host_ranks} nodes "
                f"of {host_ranks} ranks: drop node_size (the nodes are read from the launcher)"
            )
        _check_divides("node_size", node_size, world_size)
        return node_size
    if several:
        return host_ranks
    size = next((g for g in groups if isinstance(g, int)), host_ranks)
    return size if world_size % size == 0 else world_size  # one host holding a part of the world: the world is a node


def _per_node(value: int | str | None, node_size: int) -> int | None:
    """A group size as given, ``"node"`` resolved to ``node_size`` (config.py refused anything but ints and it)."""
    return node_size if value == PER_NODE else value  # type: ignore[return-value]


def launched_node_size(environ: Mapping[str, str], external: bool, devices: int, num_nodes: int,
                       world_size: int) -> int:
    """The ranks a node runs, as the launcher laid them out: its variable (``LAUNCHER_VARIABLES``) when it started
    the processes (``external``: torchrun, SLURM, ...), else the Trainer's ``devices`` (Lightning started them).
    Raises ``ZeroConfigError`` when the nodes it makes of the world disagree with the Trainer's ``num_nodes``
    (see [Note: nodes from the launcher])."""
    found = next(((name, environ[name]) for name in LAUNCHER_VARIABLES if external and environ.get(name, "").isdigit()
                  and int(environ[name]) > 0), None)
    if found is None:
        return devices
    name, value = found[0], int(found[1])
    if world_size % value or world_size // value != num_nodes:
        nodes = f"{world_size // value} nodes of {value} ranks" if world_size % value == 0 else "a ragged layout"
        raise ZeroConfigError(
            f"the launcher started {nodes} ({name}={value}, world size {world_size}), but the Trainer has "
            f"num_nodes={num_nodes} and devices={devices}: set Trainer(num_nodes={max(1, world_size // value)}, "
            f"devices={value}) to match the launch"
        )
    return value


@dataclass(frozen=True)
class Links:
    """Bytes one rank sends to other nodes in a collective of its group (see [Note: what crosses nodes]).

    ``members``: the group's global ranks in group order; ``index``: this rank's position among them;
    ``node_size``: consecutive ranks per node (``None``: one node, nothing crosses)."""

    members: tuple[int, ...]
    index: int
    node_size: int | None

    @cached_property
    def grid(self) -> tuple[int, int] | None:
        """``(G, K)`` when the members are ``G > 1`` whole nodes of ``K > 1`` members each, node by node in group
        order (group rank ``h K + j`` is member ``j`` of node ``h``): where gloo's gathers and reductions run node by
        node (by_node.py, [Note: hierarchical collectives]); else ``None``."""
        size, n = self.node_size, len(self.members)
        if size is None or n < 4:
            return None
        nodes = [m // size for m in self.members]
        k = nodes.count(nodes[0])
        blocks = [nodes[i : i + k] for i in range(0, n, k)]
        whole = n % k == 0 and all(len(set(b)) == 1 for b in blocks) and len({b[0] for b in blocks}) == len(blocks)
        return (n // k, k) if whole and 1 < k < n else None

    def _crosses(self, peer: int) -> bool:
        size = self.node_size
        return size is not None and self.members[peer] // size != self.members[self.index] // size

    def ring(self, nbytes: float) -> float:
        """A ring in group order: ``nbytes`` go to the next member."""
        n = len(self.members)
        return nbytes if n > 1 and self._crosses((self.index + 1) % n) else 0.0

    def to_each(self, nbytes: float) -> float:
        """``nbytes`` sent straight to every other member."""
        return nbytes * sum(self._crosses(p) for p in range(len(self.members)) if p != self.index)

    @cached_property
    def tree_gather_rows(self) -> int:
        """Rows this rank sends to other nodes in gloo's all-gather, one broadcast down the tree per member's row
        (the same for every gather of the group, so counted once)."""
        return int(sum(self.broadcast(1.0, root, chain=False) for root in range(len(self.members))))

    def broadcast(self, nbytes: float, root: int, chain: bool) -> float:
        """A broadcast of ``nbytes`` from group rank ``root``: a chain in group order (NCCL), or gloo's binomial
        tree: counted from the root (``v``), a member sends to ``v + 2**i`` for every ``2**i > v`` inside the
        group, so the root sends ``ceil(log2 n)`` copies and the members it reached forward them."""
        n = len(self.members)
        if not chain:
            v, sent, step = (self.index - root) % n, 0.0, 1
            while step < n:
                if v < step and v + step < n:
                    sent += nbytes * self._crosses((v + step + root) % n)
                step *= 2
            return sent
        following = (self.index + 1) % n
        return nbytes if n > 1 and following != root and self._crosses(following) else 0.0

    def all_to_all(self, counts: Sequence[int], itemsize: int, own: int) -> float:
        """An all-to-all sending ``counts[p]`` elements of ``itemsize`` bytes straight to each member ``p``."""
        return float(sum(c * itemsize for p, c in enumerate(counts) if p != own and self._crosses(p)))

    def to_peers(self, nbytes: float, peers: list[int]) -> float:
        """``nbytes`` sent straight to each of ``peers`` (group ranks)."""
        return nbytes * sum(self._crosses(p) for p in peers)
