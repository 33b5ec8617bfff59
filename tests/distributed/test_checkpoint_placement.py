"""A checkpoint leaves every tensor where it lives: saving hands the checkpoint writer DTensors around the shards
themselves, and loading an earlier checkpoint directory (DCP) reads into DTensors on the shards' device, so under
offload (host masters and optimizer states, a CUDA mesh) nothing is copied to the device, in either direction.

Without a GPU, the mesh is a CUDA ``DeviceMesh`` made without initialising a backend; any move to its device fails
here ("Torch not compiled with CUDA enabled"), which is what ``DTensor.from_local`` did with host tensors.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_zero.checkpoint.legacy import _model_destinations, optimizer_destinations
from lightning_zero.checkpoint.sharded import model_tensors, optimizer_tensors
from lightning_zero.sharding.flat_param import shard_parameters
from lightning_zero.sharding.optimizer import ShardedOptimizer
from tests.harness import run_on_ranks


def _placements(rank: int, world_size: int) -> dict:
    mesh = DeviceMesh("cuda", torch.arange(world_size), _init_backend=False)
    module = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    shards = shard_parameters(module.named_parameters(), rank, world_size, torch.float32)  # host fp32 masters
    optimizer = torch.optim.AdamW(module.parameters())
    sharded = ShardedOptimizer(optimizer, {s.param: s for s in shards})
    for shard in shards:
        shard.param.grad = torch.ones(shard.spec.local_shape)
    sharded.update([(s, s.param.grad) for s in shards])  # Adam's moments now exist, on the host

    saved = model_tensors(module, shards, mesh)
    same_storage = [saved[s.name]._local_tensor.data_ptr() == s.local.data_ptr() for s in shards]
    states = optimizer_tensors(sharded, mesh)["state"]
    moments = [v for entry in states.values() for v in entry.values() if isinstance(v, DTensor)]
    loaded = _model_destinations(module, shards, mesh)
    stored = {f"optim.{s.name}.{key}": _Meta(tuple(s.spec.shape), torch.float32)
              for s in shards for key in ("exp_avg", "exp_avg_sq")}
    destinations = optimizer_destinations(sharded, stored, "optim.", mesh)
    loading = [v for entry in destinations.values() for v in entry.values() if isinstance(v, DTensor)]
    return {
        "same_storage": same_storage,
        "devices": {t._local_tensor.device.type for t in [*saved.values(), *moments, *loaded.values(), *loading]
                    if isinstance(t, DTensor)},
        "mesh": {t.device_mesh.device_type for t in [*moments, *loading]},
        "counts": (len(moments), len(loading), len(shards)),
        "shapes": {name: tuple(t.shape) for name, t in saved.items()},
    }


class _Meta:
    """The part of DCP's ``TensorStorageMetadata`` that ``optimizer_destinations`` reads."""

    def __init__(self, size: tuple[int, ...], dtype: torch.dtype) -> None:
        self.size = size
        self.properties = type("Properties", (), {"dtype": dtype})()


def test_save_and_load_keep_host_tensors_on_the_host_with_a_cuda_mesh() -> None:
    (result,) = run_on_ranks(_placements, 1)
    assert result["same_storage"] == [True] * 4  # the DTensors wrap the masters themselves: no copy
    assert result["devices"] == {"cpu"} and result["mesh"] == {"cuda"}
    assert result["counts"] == (8, 8, 4)  # two moments of each of the 4 parameters, saved and loaded
    assert result["shapes"] == {"0.weight": (6, 4), "0.bias": (6,), "1.weight": (6,), "1.bias": (6,)}
