"""The byte accounting of collectives: what every call of a ``Collectives`` records, per kind of collective.

[Note: what the byte accounting counts]
Every call records the *logical* volume per rank of the operation the algorithm needs, as a ring implementation
moves it: ``(N-1)/N`` of the full buffer for a reduce-scatter or an all-gather, ``2(N-1)/N`` for an all-reduce and
the tensor's size for a broadcast. That is the hardware-independent figure the ZeRO paper's 2Ψ and 3Ψ refer to. The
bytes the chosen algorithm actually puts on the wire are kept beside it as ``wire_bytes`` (twice the logical figure
for the all-reduce that reduces CUDA tensors on gloo, the same figure otherwise), and ``cross_bytes``: what of it
this rank sends to another node (see [Note: what crosses nodes] in topology.py). A quantized all-gather (qwZ) counts
the payloads it moves, under ``"all_gather_quantized"`` (see [Note: the quantized all-gather]); hpZ's backward
gather inside its group, under ``"all_gather_hpz"`` (``all_gather_rows``); and a quantized reduce-scatter (qgZ) the
payloads of both its stages, under ``"reduce_scatter_quantized"`` (see [Note: the quantized reduce-scatter]).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OpStats:
    """Calls and bytes of one kind of collective since the last reset."""

    calls: int = 0
    bytes: int = 0
    wire_bytes: int = 0
    cross_bytes: int = 0


@dataclass
class CommStats:
    """Byte accounting of every collective a :class:`Collectives` issued (see [Note: what the byte accounting
    counts])."""

    by_op: dict[str, OpStats] = field(default_factory=dict)

    def record(self, op: str, nbytes: float, wire_bytes: float, cross_bytes: float = 0.0) -> None:
        stats = self.by_op.setdefault(op, OpStats())
        stats.calls += 1
        stats.bytes += round(nbytes)
        stats.wire_bytes += round(wire_bytes)
        stats.cross_bytes += round(cross_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.by_op.values())

    @property
    def cross_group_bytes(self) -> int:
        """Bytes this rank sent to ranks of other nodes (see [Note: what crosses nodes] in topology.py)."""
        return sum(s.cross_bytes for s in self.by_op.values())

    @property
    def total_calls(self) -> int:
        return sum(s.calls for s in self.by_op.values())

    def reset(self) -> None:
        self.by_op.clear()
