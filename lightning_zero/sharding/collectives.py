"""The only module that calls ``torch.distributed``: collectives on flat buffers, async handles, byte accounting.

[Note: which algorithm each collective uses]
On NCCL the native ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` are bandwidth-optimal and used as they
are. On gloo they are not: measured on 2 CPU processes with a 20.5M-element fp32 buffer (shared/DESIGN.md),
``reduce_scatter_tensor`` took 163 ms against 85 ms for an all-reduce followed by taking one's own slice, and
``all_gather_into_tensor`` took 151 ms against 48 ms for one async broadcast per rank into the output slices. So on
any backend other than NCCL the reduce-scatter is an all-reduce of the rank-major buffer (the rank keeps its
segment) and the all-gather is ``N`` concurrent broadcasts. Both give identical results; only speed differs.

[Note: what the byte accounting counts]
Every call records the *logical* volume per rank of the operation the algorithm needs, as a ring implementation
moves it: ``(N-1)/N`` of the full buffer for a reduce-scatter or an all-gather, ``2(N-1)/N`` for an all-reduce and
the tensor's size for a broadcast. That is the hardware-independent figure the ZeRO paper's 2Ψ and 3Ψ refer to. The
bytes the chosen algorithm actually puts on the wire (more, for gloo's all-reduce-based reduce-scatter) are kept
beside it as ``wire_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor


#: Bucket collectives (gradient reduce-scatters, parameter all-gathers) in flight at once: bounds the transient memory
#: of full-size bucket buffers to this many while still overlapping one with the packing of the next.
MAX_IN_FLIGHT = 2


@dataclass
class OpStats:
    """Calls and bytes of one kind of collective since the last reset."""

    calls: int = 0
    bytes: int = 0
    wire_bytes: int = 0


@dataclass
class CommStats:
    """Byte accounting of every collective a :class:`Collectives` issued (see [Note: what the byte accounting counts])."""

    by_op: dict[str, OpStats] = field(default_factory=dict)

    def record(self, op: str, nbytes: float, wire_bytes: float) -> None:
        stats = self.by_op.setdefault(op, OpStats())
        stats.calls += 1
        stats.bytes += round(nbytes)
        stats.wire_bytes += round(wire_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.by_op.values())

    @property
    def total_calls(self) -> int:
        return sum(s.calls for s in self.by_op.values())

    def reset(self) -> None:
        self.by_op.clear()


class Handle:
    """An in-flight collective; ``wait()`` blocks until it is done and runs its completion step once."""

    def __init__(self, works: list, on_done: Callable[[], None] | None = None) -> None:
        self._works = works
        self._on_done = on_done

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done()


class Collectives:
    """Collectives over one process group (default: the world), with byte accounting in ``stats``.

    A world of size 1, or no initialized process group, turns every call into a local no-op that moves no bytes.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.native = self.distributed and dist.get_backend(group) == "nccl"
        #: Where this group's collectives can read and write tensors.
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.native else torch.device("cpu")
        self.stats = CommStats()

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def reduce_scatter_mean(self, full: Tensor) -> tuple[Tensor, Handle]:
        """Average a rank-major buffer of ``N * S`` elements across ranks.

        Returns this rank's averaged segment (``S`` elements, valid once the handle is waited on) and the handle.
        ``full`` is consumed: its contents are undefined afterwards. The input is divided by ``N`` before summing,
        as ``DistributedDataParallel`` does, so the result matches its gradients.
        """
        n = self.world_size
        segment_numel = full.numel() // n
        if n == 1:
            return full, Handle([])
        full.div_(n)
        nbytes = full.numel() * full.element_size()
        if self.native:
            out = torch.empty(segment_numel, dtype=full.dtype, device=full.device)
            work = dist.reduce_scatter_tensor(out, full, group=self.group, async_op=True)
            self.stats.record("reduce_scatter", nbytes * (n - 1) / n, nbytes * (n - 1) / n)
            return out, Handle([work])
        work = dist.all_reduce(full, group=self.group, async_op=True)
        self.stats.record("reduce_scatter", nbytes * (n - 1) / n, 2 * nbytes * (n - 1) / n)
        return full.view(n, segment_numel)[self.rank], Handle([work])

    def all_gather_(self, full: Tensor) -> Handle:
        """In-place all-gather: each rank has written its own segment of ``full``; the handle fills the others."""
        n = self.world_size
        if n == 1:
            return Handle([])
        nbytes = full.numel() * full.element_size()
        self.stats.record("all_gather", nbytes * (n - 1) / n, nbytes * (n - 1) / n)
        table = full.view(n, -1)
        if self.native:
            work = dist.all_gather_into_tensor(full, table[self.rank], group=self.group, async_op=True)
            return Handle([work])
        works = [
            dist.broadcast(table[r], src=self._global_rank(r), group=self.group, async_op=True) for r in range(n)
        ]
        return Handle(works)

    def all_reduce_sum_(self, tensor: Tensor) -> None:
        """Sum ``tensor`` in place across ranks (small tensors: norms, flags)."""
        if self.world_size == 1:
            return
        nbytes = tensor.numel() * tensor.element_size()
        n = self.world_size
        self.stats.record("all_reduce", 2 * nbytes * (n - 1) / n, 2 * nbytes * (n - 1) / n)
        dist.all_reduce(tensor, group=self.group)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def device_mesh(self):
        """A 1-D ``DeviceMesh`` over this group (for DTensor views of the shards in checkpoints)."""
        from torch.distributed.device_mesh import DeviceMesh

        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(self.world_size))
        return DeviceMesh(self.device.type, ranks)

    def broadcast_(self, tensors: list[Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` in place with the values held by group rank ``src``."""
        if self.world_size == 1 or not tensors:
            return
        works = []
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            self.stats.record("broadcast", nbytes, nbytes)
            works.append(dist.broadcast(tensor, src=self._global_rank(src), group=self.group, async_op=True))
        for work in works:
            work.wait()
