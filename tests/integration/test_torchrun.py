"""Multi-node through torchrun: two single-process "nodes" on loopback, Lightning reading torchrun's environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.harness import free_port

JOB = Path(__file__).with_name("torchrun_job.py")


def test_two_nodes_under_torchrun(tmp_path: Path) -> None:
    port = free_port()
    # A clean environment: Lightning's launchers in this process (other tests) leave MASTER_PORT and PL_* behind.
    leaked = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in leaked and not k.startswith("PL_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}",
             "--master-addr=127.0.0.1", f"--master-port={port}", str(JOB), str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [r["environment"] for r in ranks] == ["TorchElasticEnvironment"] * 2
    assert [(r["global_rank"], r["node_rank"], r["world_size"]) for r in ranks] == [(0, 0, 2), (1, 1, 2)]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])  # one model, trained across both nodes
    assert len(ranks[0]["losses"]) == 3 and ranks[0]["losses"][-1] < ranks[0]["losses"][0]
