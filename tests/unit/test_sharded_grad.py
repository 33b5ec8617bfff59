"""ShardedGrad answers as the full gradient would (sharding/sharded_grad.py), without processes: two "ranks" are two
threads holding their rows of the same tensor, whose all-reduces meet at a barrier. Every operation a hook does to
``p.grad`` runs on the full tensor and, sharded, on both threads; the results (and, for edits, the full tensor
rebuilt from the rows) must be equal."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from lightning_zero.sharding import sharded_grad_ops  # noqa: F401  (what a ShardedGrad answers)
from lightning_zero.sharding.flat_param import ShardSpec
from lightning_zero.sharding.sharded_grad import RowLayout, ShardedGrad, ShardedGradientError

WORLD = 2


class ThreadGroup:
    """The ``Reducer`` of each of ``WORLD`` threads: an all-reduce is a barrier and a sum/max/min over what every
    thread brought."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(WORLD)
        self.slots: list = [None] * WORLD
        self.lock = threading.Lock()

    def owner(self, rank: int):
        group = self

        class Owner:
            def all_reduce(self, tensor, op, of, call):
                group.slots[rank] = tensor.clone()
                group.barrier.wait()
                stacked = torch.stack(group.slots)
                result = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
                group.barrier.wait()
                return result.to(tensor.dtype)

            def changed(self, key=None, factor=None):
                pass

            def whole_norms(self, ord):
                raise KeyError  # the tensors here are not handed out by a UserView

        return Owner()


def _sharded(full: torch.Tensor, rank: int, owner) -> ShardedGrad:
    spec = ShardSpec(full.shape, rank, WORLD)
    lo, hi = spec.owned_rows()
    layout = RowLayout(full.shape, lo, hi, single=full.dim() == 0)
    return ShardedGrad(spec.local_view(full.clone()).clone(), layout, owner, "w")


def _on_both(full: torch.Tensor, op) -> tuple[list, list[ShardedGrad]]:
    group, out, grads, errors = ThreadGroup(), [None] * WORLD, [None] * WORLD, []

    def run(rank: int) -> None:
        try:
            grads[rank] = _sharded(full, rank, group.owner(rank))
            out[rank] = op(grads[rank])
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out, grads


def _rebuilt(grads: list[ShardedGrad]) -> torch.Tensor:
    shape = grads[0].shape
    return torch.cat([g._local for g in grads]).view(shape)


READS = {
    "norm": lambda g: g.norm(),
    "norm_inf": lambda g: torch.linalg.vector_norm(g, math.inf),
    "norm_1": lambda g: torch.linalg.vector_norm(g, 1),
    "sum": lambda g: g.sum(),
    "mean": lambda g: g.mean(),
    "abs_max": lambda g: g.abs().max(),
    "min": lambda g: g.min(),
    "isfinite_all": lambda g: torch.isfinite(g).all(),
    "any_negative": lambda g: (g < -10).any(),
    "row_norm": lambda g: g[3].norm(),
    "row_slice_sum": lambda g: g[1:4].sum(),
    "column_sum": lambda g: g[:, 2].sum(),
    "rows_mean_norm": lambda g: g.mean(dim=0).norm(),
    "item": lambda g: g[4, 1].item(),
    "flat_view_sum": lambda g: g.view(-1)[5:20].sum(),
    "count_nonzero": lambda g: torch.count_nonzero(g > 0),
    "equal_self": lambda g: torch.equal(g, g.clone()),
    "foreach_norm": lambda g: torch._foreach_norm([g, g * 2])[1],
}


@pytest.mark.parametrize("name", READS)
def test_reads_give_the_full_tensors_answer(name: str) -> None:
    full = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))  # 7 rows: 4 and 3 per rank
    want = READS[name](full.clone())
    got, _ = _on_both(full, READS[name])
    for value in got:
        torch.testing.assert_close(torch.as_tensor(value), torch.as_tensor(want), rtol=1e-6, atol=1e-6)


EDITS = {
    "zero_rows": lambda g: g.__setitem__(slice(0, 5), 0),
    "zero_row": lambda g: g.__setitem__(6, 0.0),
    "mask_fill": lambda g: g.masked_fill_(torch.arange(35).view(7, 5) % 3 == 0, 0.0),
    "bool_index": lambda g: g.__setitem__(torch.tensor([True, False] * 3 + [True]), 1.0),
    "long_index": lambda g: g.__setitem__(torch.tensor([0, 5, 6]), -1.0),
    "column": lambda g: g.__setitem__((slice(None), 1), 2.0),
    "mul_full": lambda g: g.mul_(torch.arange(35.0).view(7, 5)),
    "clamp": lambda g: g.clamp_(-0.5, 0.5),
    "add_scaled": lambda g: g.add_(g * 0.5),
    "copy_full": lambda g: g.copy_(torch.ones(7, 5)),
    "foreach_mul": lambda g: torch._foreach_mul_([g], 3.0),
    "foreach_zero": lambda g: torch._foreach_zero_([g]),
}


@pytest.mark.parametrize("name", EDITS)
def test_edits_change_each_ranks_rows_as_the_full_tensor(name: str) -> None:
    full = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    want = full.clone()
    EDITS[name](want)
    _, grads = _on_both(full, EDITS[name])
    torch.testing.assert_close(_rebuilt(grads), want, rtol=0, atol=0)


def test_clip_grad_norm_scales_every_rank_by_the_global_norm() -> None:
    full = torch.randn(7, 5, generator=torch.Generator().manual_seed(2)) * 3
    param = torch.nn.Parameter(torch.zeros(7, 5))
    param.grad = full.clone()
    want_norm = torch.nn.utils.clip_grad_norm_([param], 1.0)

    def clip(g):
        p = torch.nn.Parameter(torch.zeros(7, 5))
        p.grad = g
        return torch.nn.utils.clip_grad_norm_([p], 1.0)

    norms, grads = _on_both(full, clip)
    assert all(torch.allclose(n, want_norm) for n in norms)
    torch.testing.assert_close(_rebuilt(grads), param.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("read", [lambda g: g.tolist(), lambda g: g[g > 0], lambda g: g.t().contiguous(),
                                  lambda g: g.numpy()])
def test_reads_that_need_other_ranks_values_are_refused(read) -> None:
    with pytest.raises(ShardedGradientError, match="gathered_gradients"):
        _on_both(torch.randn(7, 5), read)


def test_a_zero_dim_gradient_is_held_by_one_rank() -> None:
    got, grads = _on_both(torch.tensor(3.0), lambda g: (g.mul_(2), g.item())[1])
    assert got == [6.0, 6.0] and [g._local.numel() for g in grads] == [1, 0]
