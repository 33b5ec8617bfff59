"""A stage-3 parameter's values between its uses, with no processes (rank 1 of 2, the other rank's reductions
stood in for by an identity): ``p.data``/``p.detach()`` of a sharded parameter as this rank's rows, what Lightning's
weight-averaging callbacks do with them, a copy of the model cut to rows, and where a rebinding's rows go (see
[Note: a parameter's values between its uses] in sharding/sharded_param.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import get_ema_avg_fn, get_swa_multi_avg_fn

from lightning_zero.sharding.flat_param import shard_parameters
from lightning_zero.sharding.sharded_param import ShardedParameterError, ShardedValues
from lightning_zero.sharding.user_view import UserView, row_layout

RANK, WORLD = 1, 2


class _Comms:
    """A stand-in for the shard group: an all-reduce over one rank."""

    device = torch.device("cpu")

    def all_reduce_(self, tensor, what, op="sum"):
        return tensor


def _sharded(module: nn.Module) -> tuple[UserView, list]:
    """``module``'s parameters sharded as stage 3 shards them on rank 1 of 2 (fp32 masters, standalone)."""
    shards = shard_parameters(module.named_parameters(), RANK, WORLD, master_dtype=torch.float32)
    for shard in shards:
        shard.to_sharded()
    return UserView(_Comms(), shards), shards


def test_values_are_this_ranks_rows_of_the_masters_and_writes_go_into_them() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 5)  # 5 rows: rank 1 holds rows 3 and 4
    full = layer.weight.detach().clone()
    view, shards = _sharded(layer)
    values = layer.weight.detach()
    assert isinstance(values, ShardedValues) and values.shape == (5, 3) and isinstance(layer.weight.data, ShardedValues)
    torch.testing.assert_close(values._local, full[3:], rtol=0, atol=0)
    layer.weight.data.copy_(torch.arange(15.0).view(5, 3))  # a full tensor: this rank keeps its rows
    assert shards[0].local.tolist() == [[9.0, 10.0, 11.0], [12.0, 13.0, 14.0]] and view.take_written()
    assert float((layer.weight.detach() * 2).sum()) == 2 * sum(range(9, 15))  # element-wise, then a reduction
    with pytest.raises(ShardedParameterError, match=r"tolist\(\) on the values of zero3 parameter 'weight'"):
        layer.weight.detach().tolist()
    with pytest.raises(ShardedParameterError, match=r"sum\(\) on a zero3 parameter outside a gathered scope"):
        layer.weight.sum()  # the parameter itself still refuses value reads


def test_a_copy_is_cut_to_rows_and_averaged_as_the_callbacks_do() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5))
    average = copy.deepcopy(model)  # what WeightAveraging's setup makes, before the strategy shards the model
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    view, shards = _sharded(model)
    held = view.shard_copy(average, model.parameters())
    assert all(isinstance(p, ShardedValues) and isinstance(p, nn.Parameter) for p in average.parameters())
    assert held == 4 * (2 * 3 + 2 + 2 + 2)  # this rank's rows of weight, bias and BatchNorm's weight and bias
    for shard in shards:
        shard.local.add_(1.0)  # a step
    # EMA (AveragedModel with avg_fn, per tensor) and SWA (its multi_avg_fn: one _foreach_lerp_ over the
    # parameters and, with use_buffers, the whole buffers)
    ema = get_ema_avg_fn(0.75)
    for mine, theirs in zip(average.parameters(), model.parameters()):
        mine.detach().copy_(ema(mine.detach(), theirs.detach(), torch.tensor(1)))
    for name, p in average.named_parameters():
        torch.testing.assert_close(p._local, full[name].reshape(-1, *full[name].shape[1:])[3:] + 0.25)
    averaged = [*(p.detach() for p in average.parameters()), *average.buffers()]
    current = [*(p.detach() for p in model.parameters()), *(b + 1 for b in model.buffers())]
    get_swa_multi_avg_fn()(averaged[:-1], current[:-1], torch.tensor(1))  # num_batches_tracked is an integer
    torch.testing.assert_close(average[1].running_mean, torch.full((5,), 0.5))  # (0 + 1) / 2, whole
    torch.testing.assert_close(average[0].bias._local, full["0.bias"][3:] + 0.625)  # (0.25 + 1) / 2
    # a copied copy keeps its rows; a full state_dict loaded into it keeps this rank's rows
    again = copy.deepcopy(average)
    assert isinstance(again[0].weight, ShardedValues) and again[0].weight._local.data_ptr() != 0
    again.load_state_dict({**again.state_dict(), "0.weight": torch.arange(15.0).view(5, 3)})
    assert again[0].weight._local.tolist() == [[9.0, 10.0, 11.0], [12.0, 13.0, 14.0]]


def test_rebound_rows_are_aliased_like_ddps_parameter_unless_the_master_is_a_file() -> None:
    layer = nn.Linear(3, 5, bias=False)
    view, (shard,) = _sharded(layer)
    original = torch.arange(15.0).view(5, 3)  # a lottery-ticket copy's tensor
    layer.weight.data = original  # rebinding a sharded parameter: taken back by the runtime
    shard.adopt_edits(compare=False)
    assert shard.local.data_ptr() == original[3].data_ptr()  # the master is the copy's rows, as DDP's parameter
    assert shard.sharded and layer.weight.dtype == torch.float32
    copy_view = ShardedValues(torch.full((2, 3), 7.0), row_layout(shard), view._copies_owner, "weight")
    shard.master_in_file = True
    layer.weight.data = copy_view  # a sharded copy's values: their rows, copied into a master that stays put
    assert shard.local.data_ptr() == original[3].data_ptr() and original[3:].eq(7.0).all()

