"""Loading a full-shape optimizer state (a checkpoint's) into a sharded optimizer keeps nothing of the checkpoint: a
checkpoint file is mapped (``torch.load(mmap=True)``), and one tensor still viewing the mapping would keep all of it,
with every page a rank read through it, resident for the rest of the run (BENCHMARKS.md's resume phase: 12Ψ/N)."""

from __future__ import annotations

import gc

import torch
from torch import nn

from lightning_zero.sharding.flat_param import shard_parameters
from lightning_zero.sharding.optimizer import ShardedOptimizer


def _mapped(path) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(str(path)) for line in f)


def test_a_loaded_state_keeps_no_view_of_the_mapped_checkpoint(tmp_path) -> None:
    torch.manual_seed(0)
    source = nn.Linear(6, 4)
    adam = torch.optim.AdamW(source.parameters())
    source(torch.randn(3, 6)).sum().backward()
    adam.step()
    path = tmp_path / "optimizer.pt"
    torch.save(adam.state_dict(), path)

    module = nn.Linear(6, 4)
    shards = shard_parameters(module.named_parameters(), 1, 2)  # rank 1 of 2: rows 2-3 of the weight
    sharded = ShardedOptimizer(torch.optim.AdamW(module.parameters()), {s.param: s for s in shards})
    loaded = torch.load(path, mmap=True)
    sharded.load_consolidated_state_dict(loaded)
    del loaded
    gc.collect()

    assert not _mapped(path)
    state = sharded.optimizer.state[module.weight]
    expected = adam.state_dict()["state"][0]
    assert torch.equal(state["exp_avg"], expected["exp_avg"][2:4])
    assert torch.equal(state["exp_avg_sq"], expected["exp_avg_sq"][2:4])
    assert float(state["step"]) == 1.0
