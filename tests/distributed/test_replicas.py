"""``check_replicas`` on ranks whose replicated state differs in number, not only in value: every rank gets
:class:`ReplicaMismatchError` naming the counts, never a collective's size error."""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero.replicas import ReplicaMismatchError, check_replicas
from lightning_zero.sharding.collectives import Collectives
from tests.harness import run_on_ranks


def _check(module: nn.Module) -> str:
    try:
        return f"compared {check_replicas(module, Collectives(device=torch.device('cpu')))}"
    except ReplicaMismatchError as err:
        return str(err)


def _cases(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    same = nn.Linear(3, 2)
    torch.manual_seed(0)
    extra = nn.Sequential(nn.Linear(3, 2), *([nn.LayerNorm(2)] if rank == 1 else []))
    torch.manual_seed(rank)
    differing = nn.Linear(3, 2)
    return {"same": _check(same), "extra": _check(extra), "differing": _check(differing)}


def test_ranks_holding_different_numbers_of_tensors_get_a_replica_mismatch() -> None:
    results = run_on_ranks(_cases, 2, timeout_s=60)
    for rank in (0, 1):
        assert results[rank]["same"] == "compared 2"
        assert results[rank]["extra"] == "ranks hold different numbers of replicated tensors: [2, 4] (by rank)"
        assert results[rank]["differing"] == (
            "2 replicated tensor(s) differ between ranks: weight (rank(s) [1] differ from rank 0); "
            "bias (rank(s) [1] differ from rank 0)"
        )
