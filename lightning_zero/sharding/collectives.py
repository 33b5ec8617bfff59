"""The only module that issues collectives (the watchdog only reads and writes the process group's store): bucket-level
collectives, which return the handles of in_flight.py (``Gathered``, ``QuantizedGathered``, ``Reduced``,
``QuantizedReduced``, ``Exchanged``; a bucket is gathered through in_flight.py's ``gather_bucket``). ZeRO++'s quantized
collectives are in quantized_collectives.py, the byte accounting in comm_stats.py, the process groups lightning_zero
makes and tears down at exit in process_groups.py.

Every tensor handed to a collective must live on the group's device (NCCL refuses CPU tensors outright); each call
checks that and names the caller's tensor when it does not. Buckets (``buckets.Bucket``) are packed into their
rank-major buffers here, in one fused copy; in_flight.py's ``InFlight`` completes launched bucket collectives in
order while bounding how many that hold memory are pending.

[Note: how the order of collectives is owned]
Every rank must issue the same collectives on a group in the same order: gloo pairs them by order alone and aborts
(``collective mismatch``) or, between messages of one byte size, swaps their data. So the order comes from what every
rank holds alike: the model's parameter order (the shards, units and buckets keep it), the optimizers' groups, the
config, the ranks. Never from an order the interpreter picks: a ``set``'s (address order for ``torch.dtype``,
parameters, modules; hash-seed order for strings), ``id()``, ``gc``, a directory listing; they differ between ranks
that are separate interpreters (popen, torchrun, SLURM) and agree between forked ones. One collective per group: per
dtype in the order of its first parameter (``dict.fromkeys``: ``release`` in runtime.py, ``gathered_gradients`` in
user_view.py, the ownership exchanges in optimizer.py); per bucket in bucket order (grad_hooks.py, replicated.py,
unit_state.py); per unit in the order the model ran them, which the unit-order check compares across ranks
(param_hooks.py); per process group in rank order. tests/unit/test_iteration_order.py fails on a loop over a set;
tests/integration/test_launchers.py runs each stage against DDP under torchrun and popen, hash seed unset.

[Note: which algorithm each collective uses]
Where NCCL serves the group's device (backend ``"nccl"``, or a composite one that maps CUDA to it, such as
``"cpu:gloo,cuda:nccl"`` with CUDA tensors) the native ``reduce_scatter_single`` and ``all_gather_single`` are
bandwidth-optimal and used as they are. On gloo they are not: measured on 2 CPU processes with a 20.5M-element
fp32 buffer (shared/DESIGN.md),
``reduce_scatter_tensor`` took 163 ms against 85 ms for an all-reduce followed by taking one's own slice, and
``all_gather_into_tensor`` took 151 ms against 48 ms for one async broadcast per rank into the output slices. So on
any backend other than NCCL the all-gather is ``N`` concurrent broadcasts, and the reduce-scatter is an exchange:
each rank sends segment ``p`` of its rank-major buffer to rank ``p`` (``batch_isend_irecv``), receives the other
ranks' copies of its own segment and adds them to it, in rank order. That moves ``(N-1)/N`` of the buffer per rank,
as a ring reduce-scatter does and half of what an all-reduce moves; measured with torch 2.13 on a 5.1M-element fp32
buffer (one thread per rank), 17-23 ms against 28-35 ms for the all-reduce at 2 ranks, 30-37 ms against 50-72 ms at
4. At 2 ranks the sum is bitwise an all-reduce's (one addition); at more, the order of additions differs from gloo's
ring by the last bits. The received segments, ``(N-1)/N`` of the buffer, are held until the reduction completes
(``Issued.held_bytes``; ``InFlight`` bounds how many such reductions are pending). gloo sends and receives host
tensors only, so with CUDA tensors on gloo (``process_group_backend="gloo"`` on GPUs) the reduce-scatter stays an
all-reduce of the whole buffer, of which the rank keeps its segment.

[Note: ending collectives no peer will match]
A collective issued on NCCL is a kernel queued on NCCL's stream that spins until every peer has issued its
counterpart. Stage 3's unit-order check can raise on a rank that has already issued the next collective of the
expected sequence (param_hooks.py, [Note: ranks that run different units]); no peer will issue its counterpart, so
the kernel would spin until the process group's timeout (30 minutes under Lightning), and so would whatever waits
for the device after the error: freeing cached memory in teardown, and the ``destroy_process_group`` Lightning runs
at exit, whose NCCL shutdown waits for every queued kernel. ``Collectives.abort`` aborts the group
(``ProcessGroup.abort``: ``ncclCommAbort`` on its communicators), which ends the queued kernels at once; the shutdown
at exit then skips the aborted communicators, and the error reaches the user in seconds, as on gloo. The group stays
registered, so the store the watchdog reads and every other group are left alone (torch's private
``_abort_process_group`` would also unregister it, and for the default group every group and the store with it).
On gloo nothing is done: a collective no peer matches occupies the group's worker thread only, nothing waits on it
since the error is raised instead, and gloo's abort would not end such a wait anyway (watchdog.py).

[Note: hybrid sharding's collectives]
Under hybrid sharding (topology.py, [Note: hybrid sharding]) the runtime's ``Collectives`` is over the shard group,
with ``replicas`` over this rank's replica group and ``world`` over every rank (``topology_collectives`` makes them,
every rank creating every group in the same order, as torch requires). A reduce-scatter divides by the whole world
before its sum, and the reduced segment is all-reduced across ``replicas`` before it is handed over, so every caller
of ``reduce_scatter`` (stages 1-3) gets the world's mean with no change of its own. On gloo with host tensors the
shard group's exchange (inside the node) is waited for and summed where it is issued, and the all-reduce issued at
once, as FSDP2's HSDP does, so that it crosses the link while the backward goes on. Issued when the result was
needed, it left the link idle until then (1.19x FSDP2's HSDP step at 40 Mbit/s across two emulated nodes, the same
bytes); issued by a relay thread once the exchange completed, it waited for that thread's turn on 2 busy cores
(1.03-1.07x HSDP's at 10 Mbit/s, against 0.98-1.01x issued here, three A/B rounds of benchmarks/nodes.py).
Elsewhere ``Reduced.wait`` issues it, and on NCCL it is queued on the stream and the host does not wait.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.sharding import by_node
from lightning_zero.sharding.comm_stats import CommStats
from lightning_zero.sharding.buckets import Bucket
from lightning_zero.sharding.in_flight import Exchanged, Gathered, Reduced, Relays, WeightCheck
from lightning_zero.sharding.process_groups import (
    MAX_TAG, CollectiveDeviceError, device_backends, native_collective, new_group,
)
from lightning_zero.sharding.quantize import BlockFormat
from lightning_zero.sharding.quantized_collectives import QuantizedCollectives
from lightning_zero.sharding.topology import Links, Topology


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Collectives(QuantizedCollectives):
    """Collectives over one process group (default: the world) on ``device``, with byte accounting in ``stats``.

    A world of size 1, or no initialized process group, turns every call into a local no-op that moves no bytes,
    unless ``shortcut_single_rank=False`` (which still issues the collectives at world size 1, e.g. to run every
    NCCL call on one GPU). ``node_size``: consecutive global ranks per node, for ``stats``' cross-node bytes
    (``None``: one node). Under hybrid sharding ``replicas`` and ``world`` are set by ``topology_collectives``.
    """

    def __init__(
        self,
        device: torch.device | None = None,
        group: dist.ProcessGroup | None = None,
        shortcut_single_rank: bool = True,
        stats: CommStats | None = None,
        node_size: int | None = None,
    ) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.node_size = node_size
        #: Hybrid sharding: the collectives over this rank's replica group (see [Note: hybrid sharding's
        #: collectives]); ``None`` when the shards are not replicated.
        self.replicas: Collectives | None = None
        #: The collectives over every rank: ``self`` unless this group is a shard group of hybrid sharding.
        self.world: Collectives = self
        #: hpZ: the collectives over this rank's hpZ group, which the backward gathers run in (``None``: off).
        self.hpz: Collectives | None = None
        #: qwZ: the non-finite flags of the quantized gathers since the end of the last step.
        self.weight_check = WeightCheck()
        self.backend = dist.get_backend(group) if self.distributed else None
        backends = device_backends(group) if self.distributed else {}
        if device is None:
            on_cuda = backends.get("cuda") == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        if self.distributed and device.type not in backends:
            served = ", ".join(f"{t} tensors ({b})" for t, b in backends.items())
            raise CollectiveDeviceError(
                f"the process group ({self.backend}) serves {served}, but the model is on {device}"
            )
        #: Where this group's collectives read and write tensors.
        self.device = device
        #: The backend that runs this group's collectives on ``device`` ("nccl", "gloo", ...; None without a process
        #: group): a composite backend ("cpu:gloo,cuda:nccl") names one per device type.
        self.device_backend: str | None = backends.get(device.type)
        #: Whether the backend's own reduce-scatter and all-gather are used (see [Note: which algorithm each
        #: collective uses]).
        self.native = self.device_backend == "nccl"
        self.local = not self.distributed or (self.world_size == 1 and shortcut_single_rank)
        self.stats = stats if stats is not None else CommStats()
        self._control: dist.ProcessGroup | None = None
        self._exchanges = 0
        #: Issues the second stage of the collectives that run node by node (see [Note: hierarchical collectives] in
        #: by_node.py), and hybrid sharding's replica all-reduce on gloo (see [Note: hybrid sharding's collectives]).
        self.relays = Relays(f"lightning_zero-relays-{self.rank}")

    def check(self, what: str, where: Tensor | torch.device) -> None:
        """Raise, naming ``what``, unless ``where`` (a tensor or a device) is this group's device."""
        device = where.device if isinstance(where, Tensor) else where
        if device.type != self.device.type or (
            device.index is not None and self.device.index is not None and device.index != self.device.index
        ):
            raise CollectiveDeviceError(
                f"{what} is on {device}, but this process group's collectives ({self.backend or 'local'}) "
                f"work on {self.device}: move it to {self.device} before handing it to a collective"
            )

    @cached_property
    def links(self) -> Links:
        """The model of what this rank's collectives send to other nodes (see [Note: what crosses nodes])."""
        group, distributed = self.group, self.distributed
        members = dist.get_process_group_ranks(group) if distributed and group is not None else range(self.world_size)
        return Links(tuple(members), self.rank, self.node_size)

    def global_rank(self, group_rank: int) -> int:
        """The rank in the world of this group's rank ``group_rank``."""
        return self.links.members[group_rank]

    @cached_property
    def by_node(self) -> tuple[int, int] | None:
        """``(G, K)`` where this group's all-gathers and reduce-scatters run node by node, G nodes of K ranks (see
        [Note: hierarchical collectives] in by_node.py): gloo with host tensors over several whole nodes of several
        ranks each."""
        if self.native or self.local or self.device.type != "cpu":
            return None
        return self.links.grid

    # ------------------------------------------------------------------------------------------- bucket collectives

    def reduce_scatter(
        self, bucket: Bucket, grads: Sequence[Tensor | None], what: str = "gradients", buffer: Tensor | None = None,
        guard: Callable[[], None] | None = None, fmt: BlockFormat | None = None,
    ) -> Reduced:
        """Average full-shape gradients across ranks; waited, this rank's reduced shards (one view per parameter of
        ``bucket``, in the bucket's dtype). ``None`` gradients count as zeros. ``buffer``: a full-size buffer to pack
        into (default: a new one); the result may view it. ``guard``: see ``Issued``. ``fmt``: reduce as
        block-quantized payloads in this format, node by node (qgZ: see [Note: the quantized reduce-scatter])."""
        self.check(f"the {what} of {bucket.shards[0].name}", bucket.device)
        buffer = bucket.empty() if buffer is None else buffer
        bucket.pack(grads, buffer)
        n, replicas = self.world_size, self.replicas
        if self.local and replicas is None:
            return Reduced(bucket=bucket, segment=buffer, guard=guard)
        # Before the sum, as DistributedDataParallel does, so the result matches its gradients; by every rank of
        # every replica (see [Note: hybrid sharding's collectives]).
        buffer.div_(n * (replicas.world_size if replicas is not None else 1))
        if self.local:  # a shard group of one rank: the whole buffer is its segment, summed across the replicas
            return Reduced(bucket=bucket, segment=buffer, guard=guard, replicas=replicas)
        if fmt is not None:
            return self._reduce_scatter_quantized(bucket, buffer, guard, fmt)
        nbytes = buffer.numel() * buffer.element_size()
        logical = nbytes * (n - 1) / n
        if self.native:
            out = bucket.empty(bucket.segment_numel)
            reduce_scatter = native_collective("reduce_scatter_single", "reduce_scatter_tensor")
            work = reduce_scatter(out, buffer, group=self.group, async_op=True)
            self.stats.record("reduce_scatter", logical, logical, self.links.ring(logical))
            return Reduced(bucket=bucket, segment=out, works=[work], guard=guard, replicas=replicas,
                           held_bytes=out.numel() * out.element_size())
        if self.by_node is not None:
            return by_node.reduce_scatter(self, bucket, buffer, guard, replicas)
        if self.device.type != "cpu":  # gloo sends and receives host tensors only: reduce a device buffer whole
            work = dist.all_reduce(buffer, group=self.group, async_op=True)
            self.stats.record("reduce_scatter", logical, 2 * logical, self.links.ring(2 * logical))
            return Reduced(bucket=bucket, segment=bucket.segment(buffer), works=[work], guard=guard, replicas=replicas)
        received = torch.empty(n - 1, bucket.segment_numel, dtype=buffer.dtype, device=buffer.device)
        works = self._swap_segments(buffer.view(n, -1), received)
        self.stats.record("reduce_scatter", logical, logical, self.links.to_each(nbytes / n))
        segment, held = bucket.segment(buffer), received.numel() * received.element_size()
        if replicas is not None:  # the replica all-reduce, issued once the segment is summed (see the Note)
            Reduced(bucket=bucket, segment=segment, received=received, works=works, guard=guard).wait()
            replicas.record_all_reduce(segment)
            work = dist.all_reduce(segment, group=replicas.group, async_op=True)
            return Reduced(bucket=bucket, segment=segment, works=[work])
        return Reduced(bucket=bucket, segment=segment, received=received, works=works, guard=guard, held_bytes=held)

    def _swap_segments(self, table: Tensor, received: Tensor) -> list:
        """Send row ``p`` of ``table`` to group rank ``p`` and receive each other rank's row of this rank into
        ``received`` (in rank order): the exchange of a reduce-scatter (see [Note: which algorithm each collective
        uses])."""
        peers = [p for p in range(self.world_size) if p != self.rank]
        return self._exchange([(peer, table[peer], received[i]) for i, peer in enumerate(peers)])

    def _exchange(self, pairs: Sequence[tuple[int, Tensor, Tensor]]) -> list:
        """For each ``(peer, sent, received)``: send ``sent`` to group rank ``peer`` and receive its counterpart into
        ``received``, all in one batch of point-to-point operations (on NCCL one group launch, as its all-to-all
        is). Tagged per call, so that exchanges in flight together never match each other's messages."""
        self._exchanges += 1
        tag = self._exchanges % MAX_TAG
        ops = []
        for peer, sent, received in pairs:
            ops.append(dist.P2POp(dist.isend, sent, self.global_rank(peer), self.group, tag))
            ops.append(dist.P2POp(dist.irecv, received, self.global_rank(peer), self.group, tag))
        return dist.batch_isend_irecv(ops) if ops else []  # alone (shortcut_single_rank=False): nothing to swap

    def all_gather(
        self, bucket: Bucket, shards: Sequence[Tensor] | None = None, buffer: Tensor | None = None,
        guard: Callable[[], None] | None = None, fmt: BlockFormat | None = None,
    ) -> Gathered:
        """Gather every rank's shards of ``bucket`` (default: each shard's ``gather_source``, cast to the bucket's
        dtype); waited, the full rank-major buffer (``buffer`` if given), for ``Bucket.unpack`` or
        ``Bucket.unpack_to_storage``. ``guard``: see ``Issued``. ``fmt``: send each segment block-quantized in this
        format (see [Note: the quantized all-gather])."""
        sources = [s.gather_source for s in bucket.shards] if shards is None else shards
        self.check(f"the shard of {bucket.shards[0].name}", bucket.device)
        buffer = bucket.empty() if buffer is None else buffer
        with torch.no_grad():
            bucket.pack_local(sources, bucket.segment(buffer))
        if self.local:
            return Gathered(buffer=buffer, guard=guard)
        if fmt is not None:
            return self._all_gather_quantized(bucket, buffer, guard, fmt)
        table = buffer.view(self.world_size, -1)
        return Gathered(buffer=buffer, works=self._gather_rows(table, "all_gather"), guard=guard)

    def all_gather_rows(self, table: Tensor, what: str, guard: Callable[[], None] | None = None) -> Gathered:
        """All-gather the rows of ``table`` ``(n, row)`` in place, row ``r`` from group rank ``r`` (this rank's row
        already written): hpZ's backward gather of a unit's secondary shards into its storage (see [Note: hpZ's
        secondary shards] in unit_state.py), counted as ``"all_gather_hpz"``."""
        self.check(what, table)
        if self.local:
            return Gathered(buffer=table, guard=guard)
        return Gathered(buffer=table, works=self._gather_rows(table, "all_gather_hpz"), guard=guard)

    def _gather_rows(self, table: Tensor, op: str) -> list:
        """Issue the all-gather of the rows of ``table`` ``(n, row)`` (row ``r`` from group rank ``r``) and record
        its bytes under ``op``."""
        n = self.world_size
        nbytes = table.numel() * table.element_size()
        if self.by_node is not None:
            return by_node.gather_rows(self, table, op)
        if self.native:
            cross = self.links.ring(nbytes * (n - 1) / n)
        else:  # one broadcast per row, each down gloo's tree from its rank
            cross = nbytes / n * self.links.tree_gather_rows
        self.stats.record(op, nbytes * (n - 1) / n, nbytes * (n - 1) / n, cross)
        if self.native:
            gather = native_collective("all_gather_single", "all_gather_into_tensor")
            return [gather(table.view(-1), table[self.rank], group=self.group, async_op=True)]
        return [dist.broadcast(table[r], src=self.global_rank(r), group=self.group, async_op=True) for r in range(n)]

    def next_tags(self, count: int) -> Callable[[int], int]:
        """``count`` tags for one collective's point-to-point messages, ``tag(i)`` for ``i < count``, none of them
        used by another exchange in flight (every rank counts them alike, so they agree)."""
        first = self._exchanges + 1
        self._exchanges += count
        return lambda i: (first + i) % MAX_TAG

    def send(self, tensor: Tensor, peer: int, tag: int):
        """Send ``tensor`` to group rank ``peer`` (an async work): one message, not a batch (see [Note: hierarchical
        collectives] in by_node.py)."""
        return dist.isend(tensor, self.global_rank(peer), self.group, tag)

    def recv(self, tensor: Tensor, peer: int, tag: int):
        """Receive into ``tensor`` from group rank ``peer`` (an async work)."""
        return dist.irecv(tensor, self.global_rank(peer), self.group, tag)

    def close(self) -> None:
        """End the relay threads of this group and the groups beside it (a later collective starts them again)."""
        for comms in {id(c): c for c in (self, self.world, self.replicas, self.hpz) if c is not None}.values():
            comms.relays.close()

    # ----------------------------------------------------------------------------------------------- small tensors

    def all_reduce_(self, tensor: Tensor, what: str, op: str = "sum", counted_as: str = "all_reduce") -> None:
        """Reduce ``tensor`` in place across ranks with ``op`` ("sum", "max" or "min"): small tensors (norms, flags,
        counts), counted in ``stats`` under ``counted_as``."""
        self.check(what, tensor)
        if self.local:
            return
        self.record_all_reduce(tensor, counted_as)
        dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.group)

    def record_all_reduce(self, tensor: Tensor, counted_as: str = "all_reduce") -> None:
        """Count an all-reduce of ``tensor`` (a ring's volume)."""
        nbytes = tensor.numel() * tensor.element_size()
        n = self.world_size
        volume = 2 * nbytes * (n - 1) / n
        self.stats.record(counted_as, volume, volume, self.links.ring(volume))

    def all_to_all(self, send: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], what: str) -> Tensor:
        """Send ``send_counts[r]`` consecutive elements of the flat ``send`` to rank ``r`` and return what every rank
        sent this one, ``recv_counts[r]`` from rank ``r``, in rank order (optimizer ownership: sharding/ownership.py).
        Counted as what leaves this rank for another."""
        self.check(what, send)
        if self.local:
            return send.clone()
        recv = send.new_empty(sum(recv_counts))
        nbytes = (sum(send_counts) - send_counts[self.rank]) * send.element_size()
        self.stats.record("all_to_all", nbytes, nbytes, self.links.all_to_all(send_counts, send.element_size(),
                                                                              self.rank))
        dist.all_to_all_single(recv, send, list(recv_counts), list(send_counts), group=self.group)
        return recv

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (small picklable objects: optimizer state's scalars), in rank order."""
        if self.local:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        return values

    def broadcast_(self, tensors: Sequence[Tensor], what: str, src: int = 0) -> None:
        """Overwrite ``tensors`` in place with the values held by group rank ``src``."""
        for tensor in tensors:
            self.check(what, tensor)
        if self.local or not tensors:
            return
        works = []
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            self.stats.record("broadcast", nbytes, nbytes, self.links.broadcast(nbytes, src, chain=self.native))
            works.append(dist.broadcast(tensor, src=self.global_rank(src), group=self.group, async_op=True))
        for work in works:
            work.wait()

    def open_control_channel(self) -> None:
        """Make the group ``exchange`` uses: a gloo group over the same ranks, beside this one (host tensors, so
        checking costs the device nothing) and apart from it even on gloo, so that a control message is not queued
        behind the bucket collectives in flight on this group's workers. Every rank must call it, at the same point."""
        if self.local or self._control is not None:
            return
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(self.world_size))
        self._control = new_group(ranks, backend="gloo")

    def exchange(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (a few host-side integers: which collective a rank is about to issue). Control
        messages, not model state: not counted in ``stats``."""
        return self.exchange_async(values).wait()

    def exchange_async(self, values: Sequence[int]) -> Exchanged:
        """``exchange`` without waiting: waited, every rank's ``values``."""
        tensor = torch.tensor(list(values), dtype=torch.int64)
        if self.local:
            return Exchanged(tensors=[tensor])
        self.open_control_channel()
        everyone = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(everyone, tensor, group=self._control, async_op=True)
        return Exchanged(tensors=everyone, works=[work])

    def abort(self) -> None:
        """End every collective this group has in flight, before raising an error that leaves some of them without
        a counterpart on the other ranks: where NCCL serves the group's device, abort the group (it is unusable
        afterwards); on gloo nothing is done. See [Note: ending collectives no peer will match]."""
        if self.device_backend != "nccl" or self.local:
            return
        (self.group if self.group is not None else dist.group.WORLD).abort()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group, **({"device_ids": [self.device.index]} if self.native else {}))

    def device_mesh(self):
        """A 1-D ``DeviceMesh`` over this group (for DTensor views of the shards in checkpoints); a shard group of
        hybrid sharding's is made from the group itself (a new mesh over it would need every rank to make it)."""
        from torch.distributed.device_mesh import DeviceMesh

        if self.group is not None:
            return DeviceMesh.from_group(self.group, self.device.type)
        return DeviceMesh(self.device.type, list(range(self.world_size)))

    @property
    def replica_rank(self) -> int:
        """Which replica of the shards this rank holds (0 unless hybrid sharding replicates them)."""
        return self.replicas.rank if self.replicas is not None else 0


def topology_collectives(
    device: torch.device, topology: Topology, shortcut_single_rank: bool, stats: CommStats
) -> Collectives:
    """The collectives the runtime shards through: over the world when ``topology`` is flat; under hybrid sharding
    over this rank's shard group, with ``replicas`` and ``world`` (see [Note: hybrid sharding's collectives]).
    Every rank must call it at the same point: it creates every shard group, replica group and the shard groups'
    control channels, in the same order on every rank, with the world's backend; under hpZ also its groups (``hpz``,
    see [Note: hpZ's secondary shards] in unit_state.py)."""
    options = dict(shortcut_single_rank=shortcut_single_rank, stats=stats, node_size=topology.node_size)
    world = Collectives(device, **options)
    comms = world
    if topology.hybrid:
        shard_groups = [new_group(ranks) for ranks in topology.shard_groups()]
        replica_groups = [new_group(ranks) for ranks in topology.replica_groups()]
        controls = [new_group(ranks, backend="gloo") for ranks in topology.shard_groups()]
        comms = Collectives(device, shard_groups[topology.replica_rank], **options)
        comms._control = controls[topology.replica_rank]
        comms.replicas = Collectives(device, replica_groups[topology.shard_rank], **options)
        comms.world = world
    if topology.hpz_group_size is not None:
        # A group of one rank is still made (every rank makes every group), and gathers nothing (``local``).
        hpz_groups = [new_group(ranks) for ranks in topology.hpz_groups()]
        comms.hpz = Collectives(device, hpz_groups[topology.hpz_group], **options)
    return comms

