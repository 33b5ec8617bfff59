"""Emulated nodes on one machine: network namespaces joined by a veth whose rate is shaped with ``tc tbf``, a
``torchrun`` per namespace, gloo bound to the veth (shared/DESIGN.md, "Tests and measurements"). Needs root, ``ip``
and ``tc``; where a namespace cannot be made, ``EmulatedCluster`` raises ``ClusterUnavailable`` with one line saying
why (tests skip with it).

[Note: the emulated cluster]
Node ``i`` is the network namespace ``<name>n<i>``: its loopback is up, and it holds one end, ``lzlink``, of a veth
pair joining the two nodes, with the address ``10.211.0.<i+1>/24``. Both ends' egress goes through a token bucket
(``tbf``) of the link's rate, so each direction carries at most that rate, as a full-duplex link between two hosts
does. The ranks of one node reach each other over their own address, which the kernel routes through the loopback,
so the veth carries exactly what crosses nodes, and its counters (``link_bytes``) count it, TCP/IP headers included.
torchrun's agent on node 0 hosts the store (``--master-addr`` node 0's address, a static rendezvous), and
``GLOO_SOCKET_IFNAME=lzlink`` binds gloo to the veth.

Faults, as a cluster meets them:

- ``kill_node(i)``: SIGKILL to every process in the namespace (torchrun's agent and its ranks). The node's kernel
  lives on and closes their sockets, as when a node's processes are killed (out of memory, a scheduler's kill): the
  peers see their connections reset.
- ``partition()``: both ends' qdisc becomes ``blackhole``, which drops every packet silently, as a cut cable or a
  dead switch: no reset, no FIN, both sides' sends go nowhere. ``heal()`` restores the token buckets.

Names are drawn per cluster (a few hex digits), so that several clusters (other test runs on the machine) coexist;
the addresses are the same in each, which is harmless, since each pair lives in namespaces of its own. ``close()``
(the context manager's exit, also on failure) kills what still runs in the namespaces and deletes them, which
deletes the veth.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: The veth's name inside each namespace (the same in both: names are per namespace).
LINK = "lzlink"
#: The store's port on node 0 (each cluster's namespaces are fresh: nothing else listens there).
STORE_PORT = 29500
ROOT = Path(__file__).resolve().parents[1]


class ClusterUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``/``tc``, or the kernel refused)."""


def address(node: int) -> str:
    return f"10.211.0.{node + 1}"


@dataclass(frozen=True)
class Node:
    """One emulated node: its namespace and index."""

    namespace: str
    index: int

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def tbf_arguments(rate_mbit: float) -> list[str]:
    """``tc`` arguments of a token bucket of ``rate_mbit`` Mbit/s. The bucket holds at least 128 KiB: the veth hands
    the qdisc segmentation-offloaded packets of up to 64 KiB, and tbf drops a packet larger than its bucket; the
    queue holds 200 ms of the rate (TCP's window fills it, not more)."""
    rate = rate_mbit * 1e6 / 8  # bytes a second
    burst = max(128 * 1024, int(rate / 250))
    limit = burst + int(rate * 0.2)
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]


class EmulatedCluster:
    """``nodes`` (2) emulated nodes joined by a veth of ``rate_mbit`` each way (see [Note: the emulated cluster]);
    a context manager that tears them down on exit."""

    def __init__(self, rate_mbit: float = 1000.0, nodes: int = 2) -> None:
        if nodes != 2:
            raise ValueError(f"nodes={nodes} is not supported: one veth joins exactly 2 nodes")
        self.rate_mbit = rate_mbit
        self.name = f"lzc{uuid.uuid4().hex[:6]}"
        self.nodes = [Node(f"{self.name}n{i}", i) for i in range(nodes)]
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []

    # ------------------------------------------------------------------------------------------------ lifetime

    def __enter__(self) -> EmulatedCluster:
        why = unavailable()
        if why is not None:
            raise ClusterUnavailable(why)
        try:
            self._make()
        except (subprocess.CalledProcessError, OSError) as err:
            self.close()
            detail = getattr(err, "stderr", None) or str(err)
            raise ClusterUnavailable(f"network namespaces cannot be made here: {str(detail).strip()[:200]}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        a, b = self.nodes
        for node in self.nodes:
            _ip("netns", "add", node.namespace)
            self._made.append(node.namespace)
        _ip("link", "add", LINK, "netns", a.namespace, "type", "veth", "peer", "name", LINK, "netns", b.namespace)
        for node in self.nodes:
            _ip("-n", node.namespace, "addr", "add", f"{address(node.index)}/24", "dev", LINK)
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            _ip("-n", node.namespace, "link", "set", LINK, "up")
        self.shape(self.rate_mbit)

    def close(self) -> None:
        """Kill every process left in the namespaces, then delete them (and with them the veth)."""
        for proc in self._procs:
            if proc.poll() is None:
                _kill_group(proc)
        for namespace in self._made:
            self._kill_namespace(namespace)
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for namespace in self._made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._made.clear()

    # ------------------------------------------------------------------------------------------------ the link

    def shape(self, rate_mbit: float) -> None:
        """Both ends' egress at ``rate_mbit`` Mbit/s (also heals a partition)."""
        self.rate_mbit = rate_mbit
        for node in self.nodes:
            _tc(node, "qdisc", "replace", "dev", LINK, "root", *tbf_arguments(rate_mbit))

    def partition(self) -> None:
        """Drop every packet on the link, both ways, silently."""
        for node in self.nodes:
            _tc(node, "qdisc", "replace", "dev", LINK, "root", "blackhole")

    def heal(self) -> None:
        self.shape(self.rate_mbit)

    def link_bytes(self, node: int) -> int:
        """Bytes node ``node`` has sent on the link (its veth end's ``tx_bytes``: payload and TCP/IP headers)."""
        out = _ip("-n", self.nodes[node].namespace, "-j", "-s", "link", "show", "dev", LINK)
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    # ------------------------------------------------------------------------------------------------ processes

    def popen(self, node: int, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` in node ``node``'s namespace, in a session of its own; killed at ``close()``."""
        proc = subprocess.Popen(self.nodes[node].command(argv), env=env, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def torchrun(
        self, node: int, script: Sequence[str], nproc_per_node: int, env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> subprocess.Popen:
        """``torchrun --nnodes 2 --nproc-per-node nproc_per_node`` of ``script`` (a path and its arguments) on node
        ``node``, gloo bound to the link, the store on node 0; output to ``log`` (default: a pipe)."""
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(self.nodes)}",
                f"--nproc-per-node={nproc_per_node}", f"--node-rank={node}", f"--master-addr={address(0)}",
                f"--master-port={STORE_PORT}", "--max-restarts=0", "--monitor-interval=0.1", *script]
        out = open(log, "w") if log is not None else subprocess.PIPE  # noqa: SIM115 (closed with the process)
        proc = self.popen(node, argv, env=job_environment(env), stdout=out, stderr=subprocess.STDOUT, text=True)
        if log is not None:
            out.close()  # the child holds its own copy
        return proc

    def kill_node(self, node: int) -> None:
        """SIGKILL every process in node ``node``'s namespace (see [Note: the emulated cluster])."""
        self._kill_namespace(self.nodes[node].namespace)

    def pids(self, node: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.nodes[node].namespace], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def _kill_namespace(self, namespace: str) -> None:
        out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
        for pid in (int(p) for p in out.stdout.split()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def job_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a job on the cluster: this one without what launchers in this process left behind
    (``MASTER_PORT``, ``PL_*``: other tests), one thread a rank, gloo on the link, the repository importable."""
    leaked = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
              "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in leaked and not k.startswith(("PL_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOO_SOCKET_IFNAME=LINK,
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p))
    env.update(extra or {})
    return env


def unavailable() -> str | None:
    """Why no emulated cluster can be made here, or ``None``."""
    if os.geteuid() != 0:
        return "emulated nodes need root (network namespaces)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated nodes need {' and '.join(missing)} (iproute2)"
    return None


def wait_all(procs: Sequence[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Wait until every process has ended or ``timeout_s`` passed; their exit codes (``None``: still running)."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [proc.poll() for proc in procs]


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def _tc(node: Node, *args: str) -> None:
    subprocess.run(node.command(["tc", *args]), check=True, capture_output=True, text=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
