"""Loading a full-shape optimizer state (a checkpoint's) into a sharded optimizer keeps nothing of the checkpoint: a
checkpoint file is mapped (``torch.load(mmap=True)``), and one tensor still viewing the mapping would keep all of it,
with every page a rank read through it, resident for the rest of the run (BENCHMARKS.md's resume phase: 12Ψ/N)."""

from __future__ import annotations

import gc
import os

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


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


def test_rows_read_from_a_mapped_checkpoint_leave_memory_once_copied(tmp_path) -> None:
    """A rank copies its rows of each state out of the mapped file; the pages it read are reclaimed as it goes, so a
    load does not hold its rows twice (copied and mapped) at its peak."""
    rows, width = 4096, 1024  # 16 MiB of exp_avg and of exp_avg_sq
    weight = nn.Parameter(torch.zeros(rows, width))
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(rows, width),
                           "exp_avg_sq": torch.rand(rows, width)}},
             "param_groups": [{**torch.optim.AdamW([weight]).param_groups[0], "params": [0]}]}
    path = tmp_path / "optimizer.pt"
    torch.save(state, path)
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # start cold: pages counted when read

    (shard,) = shard_parameters([("weight", weight)], 0, 2)  # rank 0 of 2: the first 2048 rows
    sharded = ShardedOptimizer(torch.optim.AdamW([weight]), {weight: shard})
    loaded = torch.load(path, mmap=True)
    before = _rss_file()
    sharded.load_consolidated_state_dict(loaded)
    mapped_now = _rss_file() - before
    assert mapped_now < 2 * 2**20, mapped_now / 2**20  # without reclaiming: the 16 MiB of rows read
    got = sharded.optimizer.state[weight]["exp_avg"]
    assert torch.equal(got, state["state"][0]["exp_avg"][: rows // 2].flatten()[: got.numel()].view_as(got))
