"""The bytes rank processes send one another, read from the kernel's TCP counters (``ss -tinpH``): the check of the
strategy's own byte accounting against the sockets (benchmarks/zeropp.py).

[Note: counting bytes on the sockets]
gloo connects every pair of ranks of each process group by TCP (one connection per pair and group), and the
TCPStore's clients connect to the store's port on the master. ``ss -tinpH`` lists every TCP socket with its local
and peer address, the process holding it (``users:(("python",pid=...,fd=...))``) and the kernel's counters:
``bytes_acked`` (payload bytes the peer acknowledged), ``bytes_sent`` (payload bytes sent, retransmissions
included: loopback retransmits a little, so ``bytes_sent`` overcounts by ``bytes_retrans``) and ``bytes_received``.
A counter that is still zero is left out of the line.

Each rank snapshots its own sockets (those its process holds) at the same point of two steps, with nothing of its
own in flight (``Send-Q`` zero: every byte written has been acknowledged), and the figures are the differences of
``bytes_acked``. A socket's peer rank is the rank whose process holds the socket at the other end (local and peer
addresses swapped), found among the snapshots of all ranks. Connections to or from the store's port are left out:
the store is the launcher's rendezvous and the watchdog's channel, not a collective.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

_PROCESS = re.compile(r"pid=(\d+)")
_COUNTER = re.compile(r"\b(bytes_acked|bytes_sent|bytes_retrans|bytes_received):(\d+)")


@dataclass(frozen=True)
class Socket:
    """One TCP socket of ``ss -tinpH``: its addresses as ``host:port`` strings and its counters."""

    local: str
    peer: str
    pid: int
    send_q: int
    bytes_acked: int = 0
    bytes_sent: int = 0
    bytes_retrans: int = 0
    bytes_received: int = 0

    @property
    def local_port(self) -> int:
        return int(self.local.rsplit(":", 1)[1])

    @property
    def peer_port(self) -> int:
        return int(self.peer.rsplit(":", 1)[1])

    def as_dict(self) -> dict:
        return asdict(self)


def parse_ss(text: str) -> list[Socket]:
    """The sockets of ``ss -tinpH`` output: a line per socket (state, Recv-Q, Send-Q, local, peer, process), its
    counters on the indented line(s) that follow. Sockets without a process (another user's, or closing) are
    skipped."""
    sockets: list[Socket] = []
    head: list[str] | None = None
    counters: dict[str, int] = {}

    def flush() -> None:
        if head is None:
            return
        pid = _PROCESS.search(" ".join(head[5:]))
        if pid is not None:
            sockets.append(Socket(_address(head[3]), _address(head[4]), int(pid.group(1)), int(head[2]), **counters))

    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            counters.update((name, int(value)) for name, value in _COUNTER.findall(line))
            continue
        flush()
        head, counters = line.split(), {}
        if len(head) < 5:
            raise ValueError(f"ss line {line!r} is not a socket line: expected state, Recv-Q, Send-Q, local, peer")
    flush()
    return sockets


def _address(text: str) -> str:
    """``host:port``, with IPv6 brackets and an IPv4-mapped prefix taken off and an interface suffix dropped, so
    that the two ends of a loopback connection spell each other's addresses alike."""
    host, port = text.rsplit(":", 1)
    host = host.strip("[]").split("%", 1)[0]
    if host.startswith("::ffff:"):
        host = host[len("::ffff:"):]
    return f"{host}:{port}"


def own_sockets(pid: int, settle_s: float = 2.0) -> list[Socket]:
    """The TCP sockets process ``pid`` holds, read once every byte it wrote is acknowledged (``Send-Q`` zero on
    each), or after ``settle_s`` seconds as they are then."""
    deadline = time.monotonic() + settle_s
    while True:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
        mine = [s for s in parse_ss(out) if s.pid == pid]
        if all(s.send_q == 0 for s in mine) or time.monotonic() > deadline:
            return mine
        time.sleep(0.01)


def sent_per_peer(before: Mapping[int, Iterable[Socket]], after: Mapping[int, Iterable[Socket]],
                  store_port: int) -> dict[int, dict[int, int]]:
    """For each rank, the bytes it sent to each other rank between two snapshots: ``before`` and ``after`` map a
    rank to its own sockets. A connection opened in between counts from zero; one to or from ``store_port`` is left
    out, and so is any socket whose other end no rank holds (see [Note: counting bytes on the sockets])."""
    after = {rank: list(sockets) for rank, sockets in after.items()}
    holder = {(s.local, s.peer): rank for rank, sockets in after.items() for s in sockets}
    start = {(rank, s.local, s.peer): s.bytes_acked for rank, sockets in before.items() for s in sockets}
    out: dict[int, dict[int, int]] = {rank: {} for rank in after}
    for rank, sockets in after.items():
        for s in sockets:
            if store_port in (s.local_port, s.peer_port):
                continue
            peer = holder.get((s.peer, s.local))
            if peer is None or peer == rank:
                continue
            sent = s.bytes_acked - start.get((rank, s.local, s.peer), 0)
            out[rank][peer] = out[rank].get(peer, 0) + sent
    return out


def cross_node(sent: Mapping[int, Mapping[int, int]], node_size: int) -> dict[int, int]:
    """Per rank, what it sent to ranks of other nodes (``node_size`` consecutive ranks a node)."""
    return {rank: sum(n for peer, n in peers.items() if peer // node_size != rank // node_size)
            for rank, peers in sent.items()}
