"""Failures across two emulated nodes (tests/cluster.py), zero3 under ``torchrun --nnodes 2 --nproc-per-node 2``
(tests/integration/cluster_job.py ``train``): a whole node killed, and the link between the nodes cut. Slow (about
2 minutes on 2 cores); skipped, in one line, where namespaces cannot be made. The third failure behaviour of issue 37,
no abort at exit without ``destroy_process_group``, is checked by every run of tests/integration/test_emulated_nodes.py.

The heartbeat here is long (10 s), so that an implementation that waits for heartbeats to find a dead node would
miss the bounds by seconds, and the times do not depend on when the last beat fell.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightning_zero.watchdog import PROBE_S
from tests.cluster import ClusterUnavailable, EmulatedCluster

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parents[1] / "integration" / "cluster_job.py"
HEARTBEAT_S = 10.0
#: Issue 37: a killed node ends every survivor within 2 s.
KILLED_BOUND_S = 2.0
#: A partition: the timeout of a silent peer (or store), then one heartbeat and the grace period at most.
PARTITION_TIMEOUT_S, PARTITION_HEARTBEAT_S = 8.0, 1.0
PARTITION_MARGIN_S = 10.0


@contextmanager
def emulated_cluster() -> Iterator[EmulatedCluster]:
    """Two fresh nodes (a job's failure leaves them unusable for the next), or the test skipped."""
    cluster = EmulatedCluster(200.0)
    try:
        cluster.__enter__()
    except ClusterUnavailable as why:
        pytest.skip(str(why))
    try:
        yield cluster
    finally:
        cluster.close()


def _start(cluster: EmulatedCluster, tmp_path: Path, **env: str) -> list[Path]:
    """The ``train`` job on both nodes, run until its third step has begun; the nodes' logs."""
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    env = dict(LZ_STEPS="100000", **env)
    jobs = [cluster.torchrun(node, [str(JOB), str(tmp_path), "train"], 2, env=env, log=logs[node]) for node in (0, 1)]
    deadline = time.monotonic() + 180
    while "step 3 " not in logs[0].read_text():
        assert time.monotonic() < deadline and all(job.poll() is None for job in jobs), logs[0].read_text()[-3000:]
        time.sleep(0.1)
    return logs


def _ranks(cluster: EmulatedCluster, node: int) -> list[int]:
    """The rank processes of ``node`` (not torchrun's agent)."""
    pids = []
    for pid in cluster.pids(node):
        try:
            if "torch.distributed.run" not in Path(f"/proc/{pid}/cmdline").read_text():
                pids.append(pid)
        except FileNotFoundError:
            pass
    return pids


def _ended(pids: list[int], since: float, limit_s: float) -> dict[int, float]:
    """Seconds from ``since`` until each process ended (a zombie counts: it runs nothing), for at most ``limit_s``."""
    ended: dict[int, float] = {}
    while len(ended) < len(pids) and time.monotonic() - since < limit_s:
        for pid in pids:
            if pid not in ended and _state(pid) in ("Z", None):
                ended[pid] = time.monotonic() - since
        time.sleep(0.02)
    return ended


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return None


@dataclass
class Killed:
    """Node 1 killed while the job trained: seconds from the kill until each rank of node 0 had raised and torn
    down (its interpreter's exit began: cluster_job.py prints ``exit rank R t=...``) and until its process ended."""

    torn_down: list[float]
    ended: list[float]
    log: str


def _kill(tmp_path: Path, strategy: str) -> Killed:
    tmp_path.mkdir()
    with emulated_cluster() as cluster:
        logs = _start(cluster, tmp_path, LZ_STRATEGY=strategy, LZ_HEARTBEAT_S=str(HEARTBEAT_S),
                      LZ_FAILURE_TIMEOUT_S=str(6 * HEARTBEAT_S))
        survivors = _ranks(cluster, 0)
        killed, wall = time.monotonic(), time.time()
        cluster.kill_node(1)
        ended = _ended(survivors, killed, limit_s=4 * HEARTBEAT_S)
    log = logs[0].read_text()
    assert len(ended) == len(survivors) == 2, (strategy, ended, log[-3000:])
    torn_down = [float(line.rsplit("t=", 1)[1]) - wall for line in log.splitlines() if line.startswith("exit rank")]
    assert len(torn_down) == 2, log[-3000:]
    return Killed(sorted(torn_down), sorted(ended.values()), log)


def test_a_killed_node_ends_every_survivor_within_2_s_naming_its_ranks(tmp_path: Path) -> None:
    ddp = _kill(tmp_path / "ddp", "ddp")
    zero3 = _kill(tmp_path / "zero3", "zero3")
    print(f"after the kill, zero3's survivors tore down at {zero3.torn_down} s and ended at {zero3.ended} s; "
          f"DDP's at {ddp.torn_down} and {ddp.ended}")
    # Raising, probing (naming the dead ranks) and Lightning's teardown: within the bound whatever the load.
    assert max(zero3.torn_down) <= KILLED_BOUND_S, zero3.torn_down
    # Then the interpreter's exit, the same as DDP's (importing torch and Lightning and exiting takes 2.5-4 s in the
    # exit alone on this machine under load 16, a fraction of a second idle): 2 s, or DDP's time plus the probe and
    # the load's noise, whichever is larger; an implementation waiting on the 10 s heartbeat takes over 20 s.
    assert max(zero3.ended) <= max(KILLED_BOUND_S, max(ddp.ended) + PROBE_S + 2.0), (zero3.ended, ddp.ended)
    assert "rank 2 did not answer a probe within" in zero3.log and "(as did rank 3)" in zero3.log, zero3.log[-3000:]


def test_a_partition_ends_both_sides_within_the_failure_timeout(tmp_path: Path) -> None:
    with emulated_cluster() as cluster:
        logs = _start(cluster, tmp_path, LZ_HEARTBEAT_S=str(PARTITION_HEARTBEAT_S),
                      LZ_FAILURE_TIMEOUT_S=str(PARTITION_TIMEOUT_S))
        ranks = {node: _ranks(cluster, node) for node in (0, 1)}
        cut = time.monotonic()
        cluster.partition()
        ended = _ended(ranks[0] + ranks[1], cut, limit_s=PARTITION_TIMEOUT_S + 3 * PARTITION_MARGIN_S)
    texts = [log.read_text() for log in logs]
    print(f"ranks ended {sorted(ended.values())} s after the cut")
    assert len(ended) == 4, (ended, texts[1][-3000:])
    assert all(PARTITION_TIMEOUT_S - 1 <= t <= PARTITION_TIMEOUT_S + PARTITION_MARGIN_S for t in ended.values()), ended
    # The reachable side names a silent rank of the other node; the cut-off side, the store it can no longer reach.
    assert "sent no heartbeat for" in texts[0] and ("rank 2 " in texts[0] or "rank 3 " in texts[0]), texts[0][-3000:]
    assert "the process group's store, in the torchrun agent of the first node, is unreachable" in texts[1], texts[1]
    assert "exiting with code 69" in texts[1]
