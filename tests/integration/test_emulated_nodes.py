"""Two emulated nodes (tests/cluster.py: network namespaces joined by a shaped veth), a real ``torchrun --nnodes 2
--nproc-per-node 2`` in each, gloo on the veth: the nodes come from the launcher, a Trainer that contradicts them is
refused, zero3 flat and hybrid (one shard group per node) end with DDP's losses, the strategy's count of the bytes
that cross nodes agrees with the link's counters, and a script that never destroys its process group exits cleanly.
One job (cluster_job.py ``parity``) runs it all, in about 25 s on 2 cores. Skipped, in one line, where namespaces
cannot be made (not root, no iproute2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.cluster import ClusterUnavailable, EmulatedCluster, wait_all

JOB = Path(__file__).with_name("cluster_job.py")
#: Mbit/s each way: a few steps of the job's model take a few seconds at this rate.
RATE = 200.0


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory) -> list[dict]:
    """The job's record of each rank (one run for the module's tests)."""
    tmp_path = tmp_path_factory.mktemp("nodes")
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    try:
        with EmulatedCluster(RATE) as cluster:
            jobs = [cluster.torchrun(node, [str(JOB), str(tmp_path), "parity"], 2, log=logs[node]) for node in (0, 1)]
            codes = wait_all(jobs, timeout_s=300)
    except ClusterUnavailable as why:
        pytest.skip(str(why))
    text = "\n".join(log.read_text()[-3000:] for log in logs)
    assert codes == [0, 0], text
    assert "terminate called" not in text, text
    records = [torch.load(tmp_path / f"parity.rank{r}.pt", weights_only=False) for r in range(4)]
    for r, record in enumerate(records):
        record["at_exit"] = (tmp_path / f"exit.rank{r}.txt").read_text()
    return records


def test_nodes_come_from_the_launcher_and_sharding_ends_with_ddps_losses(parity_run: list[dict]) -> None:
    for rank, record in enumerate(parity_run):
        assert record["mismatch"] == (
            "the launcher started 2 nodes of 2 ranks (LOCAL_WORLD_SIZE=2, world size 4), but the Trainer has "
            "num_nodes=1 and devices=4: set Trainer(num_nodes=2, devices=2) to match the launch"
        )
        ddp = record["ddp"]
        assert len(ddp["losses"]) == 3
        for name, group in (("zero3", 4), ("hybrid", 2)):
            run = record[name]
            assert (run["node_size"], run["shard_group_size"]) == (2, group), (rank, name)
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=0)
            torch.testing.assert_close(run["params"], ddp["params"], rtol=1e-4, atol=1e-6)


def test_the_bytes_counted_across_nodes_are_those_on_the_link(parity_run: list[dict]) -> None:
    # What a node's two ranks counted as sent to the other node, against its end of the veth: the link carries that
    # payload plus TCP/IP headers (about 4%), the launcher's and watchdog's store traffic and Lightning's barriers.
    for name in ("zero3", "hybrid"):
        for node in (0, 1):
            counted = sum(parity_run[r][name]["cross_bytes"] for r in (2 * node, 2 * node + 1))
            sent = parity_run[2 * node][name]["link_bytes"]
            assert counted <= sent <= 1.1 * counted, (name, node, counted, sent)
    flat = sum(r["zero3"]["cross_bytes"] for r in parity_run)
    hybrid = sum(r["hybrid"]["cross_bytes"] for r in parity_run)
    assert hybrid < flat / 2  # only the all-reduce of the gradient shard crosses


def test_the_process_groups_are_destroyed_at_exit_when_the_script_does_not(parity_run: list[dict]) -> None:
    assert [record["at_exit"] for record in parity_run] == ["initialized=False"] * 4
