"""gloo's all-gather and reduce-scatter over whole nodes of several ranks, node by node, so that each node's share
crosses the link between nodes once. ``Collectives`` runs them where ``by_node`` says so; nothing here calls
``torch.distributed``: the messages are ``Collectives.send`` and ``recv``, the second stages ``Collectives.relays``.

[Note: hierarchical collectives]
gloo's collectives do not know where the nodes are: its all-gather here was one broadcast per rank down a binomial
tree, which at 2 nodes x 2 sends 5/8 of the buffer across per rank on average, and the reduce-scatter an exchange
that sends a rank's copy of each segment straight to its owner, half of the buffer across. Each node needs the other
nodes' rows (all-gather), or their partial sums of its rows (reduce-scatter), only once. So over G nodes of K ranks
(``Collectives.by_node``):

- all-gather (``gather_rows``): this rank sends its row to the ranks at its position on the other nodes (the only
  bytes that cross: ``(G-1)`` rows) and to its node's other ranks; once the rows from the other nodes are in, it
  forwards each to its node's other ranks, and receives theirs likewise.
- reduce-scatter (``reduce_scatter``): this rank sends each of its node's other ranks its copies of the segments at
  their position (all G nodes' segments at that position), sums the copies of the segments at its own position it
  receives, then sends each other node its partial sum of that node's segment (``(G-1)`` segments cross) and adds
  theirs of its own segment, in the order of the nodes.

Per rank, ``(N-1)/N`` of the buffer leaves it either way, as a ring moves it, of which ``(G-1)/N`` crosses nodes (at
2 x 2: a quarter, where the tree sent 5/8 and the exchange a half); the logical bytes in ``stats`` are unchanged, the
cross-node bytes those of this algorithm. Measured across 2 emulated nodes of 2 ranks (benchmarks/nodes.py), flat
zero3 sent 23.3 MB a step across the link before and 10.0 MB after, FSDP2 flat 20.1 MB.

The second stage (the forwards; the partial sums across) depends on the first, and is issued by ``Relays``'s thread
as soon as the first completes: were it issued when the caller waits, as qgZ's second stage is, the link would stand
idle until a reduction's result is needed. Point-to-point operations one by one (not ``batch_isend_irecv``, whose
coalescing state is global and not for two threads at once), each tagged from a block fixed when the collective is
issued (``next_tags``), so that the thread that issues them does not change which messages pair up. Host tensors
only (gloo's point-to-point); NCCL's native collectives are untouched, and so are groups inside one node (hybrid
sharding's shard groups, hpZ's) or with one rank a node (replica groups), where nothing would change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_zero.sharding.buckets import Bucket
from lightning_zero.sharding.in_flight import Reduced

if TYPE_CHECKING:
    from lightning_zero.sharding.collectives import Collectives


def gather_rows(comms: Collectives, table: Tensor, op: str) -> list:
    """Issue the all-gather of the rows of ``table`` ``(n, row)`` (row ``r`` from group rank ``r``, this rank's
    written) node by node, and record its bytes under ``op``; the works to wait for."""
    nodes, size = comms.by_node
    node, member = divmod(comms.rank, size)
    mates = [j for j in range(size) if j != member]
    others = [h for h in range(nodes) if h != node]
    tag = comms.next_tags(nodes + 1)
    own = table[comms.rank]
    works = [work for j in mates for work in (comms.send(own, node * size + j, tag(node)),
                                               comms.recv(table[node * size + j], node * size + j, tag(node)))]
    across = [work for h in others for work in (comms.send(own, h * size + member, tag(nodes)),
                                                 comms.recv(table[h * size + member], h * size + member, tag(nodes)))]
    works += [comms.recv(table[h * size + j], node * size + j, tag(h)) for h in others for j in mates]

    def forward() -> list:  # the other nodes' rows at this rank's position, to the node's other ranks
        return [comms.send(table[h * size + member], node * size + j, tag(h)) for h in others for j in mates]

    nbytes = table.numel() * table.element_size()
    _record(comms, op, nbytes, [h * size + member for h in others])
    return [*works, comms.relays.after(across, forward)]


def reduce_scatter(comms: Collectives, bucket: Bucket, buffer: Tensor, guard: Callable[[], None] | None,
                   replicas: Collectives | None) -> Reduced:
    """The reduce-scatter of ``bucket``'s buffer, already divided by the world, node by node: this rank sums the
    segments at its position of its node's ranks, then sends each other node its partial sum of that node's segment,
    and adds theirs of its own (under hybrid sharding, then all-reduced across ``replicas`` when waited)."""
    nodes, size = comms.by_node
    node, member = divmod(comms.rank, size)
    table = buffer.view(nodes, size, -1)
    column = table[:, member]  # the segments at this rank's position: summed here, in place
    mates = [j for j in range(size) if j != member]
    others = [h for h in range(nodes) if h != node]
    tag = comms.next_tags(nodes + 1)
    received = torch.empty(len(mates), nodes, column.shape[-1], dtype=buffer.dtype, device=buffer.device)
    inside = [work for i, j in enumerate(mates) for h in range(nodes) for work in (
        comms.send(table[h, j], node * size + j, tag(h)), comms.recv(received[i, h], node * size + j, tag(h)))]
    partials = torch.empty(len(others), column.shape[-1], dtype=buffer.dtype, device=buffer.device)
    inbound = [comms.recv(partials[i], h * size + member, tag(nodes)) for i, h in enumerate(others)]

    def across() -> list:  # once the node's copies are in: this rank's partial sums to the other nodes
        for copy in received:  # in the order of the node's ranks
            column.add_(copy)
        return [comms.send(column[h], h * size + member, tag(nodes)) for h in others]

    _record(comms, "reduce_scatter", buffer.numel() * buffer.element_size(), [h * size + member for h in others])
    held = (received.numel() + partials.numel()) * buffer.element_size()
    return Reduced(bucket=bucket, segment=column[node], received=partials, guard=guard, held_bytes=held,
                   works=[*inbound, comms.relays.after(inside, across)], replicas=replicas)


def _record(comms: Collectives, op: str, nbytes: int, across: list[int]) -> None:
    """The logical bytes of a gather or reduction of ``nbytes`` (a ring's, as the wire's here), one segment to each
    of the group ranks ``across``."""
    n = comms.world_size
    logical = nbytes * (n - 1) / n
    comms.stats.record(op, logical, logical, comms.links.to_peers(nbytes / n, across))
