"""ZeroRuntime: the per-fit composition of a stage's parts around one module.

Stage 1 is the sharded optimizer plus a reduction of full gradients at the accumulation boundary; stage 2 swaps in
the reducer that keeps only gradient shards. What each stage adds is the choice made in ``_REDUCERS``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.flat_param import ParamShard, shard_parameters
from lightning_zero.sharding.grad_hooks import FullGradReducer, GradReducer, ShardGradReducer
from lightning_zero.sharding.optimizer import ShardedOptimizer

_REDUCERS: dict[int, type[GradReducer]] = {1: FullGradReducer, 2: ShardGradReducer}


class ZeroRuntime:
    """Shards ``module``'s parameters, reduces its gradients and shards the optimizers of one fit."""

    def __init__(self, module: nn.Module, config: ZeroConfig, comms: Collectives) -> None:
        self.module = module
        self.config = config
        self.comms = comms
        named = [(n, p) for n, p in module.named_parameters() if p.numel() > 0]
        self.shards: list[ParamShard] = shard_parameters(named, comms.rank, comms.world_size)
        self._shard_of = {s.full: s for s in self.shards}
        self.reducer = _REDUCERS[config.stage](
            self.shards, comms, config.bucket_bytes, find_unused_parameters=config.find_unused_parameters
        )
        self.optimizers: dict[int, ShardedOptimizer] = {}
        self._buffer_hook = None
        if config.broadcast_buffers and _floating_buffers(module):
            self._buffer_hook = module.register_forward_pre_hook(self._broadcast_buffers)

    def shard_optimizer(self, optimizer: Optimizer) -> ShardedOptimizer:
        sharded = ShardedOptimizer(optimizer, self._shard_of, self.comms, self.config.bucket_bytes)
        self.optimizers[id(optimizer)] = sharded
        return sharded

    def sharded(self, optimizer: Optimizer) -> ShardedOptimizer:
        try:
            return self.optimizers[id(optimizer)]
        except KeyError:
            raise RuntimeError(
                f"{type(optimizer).__name__} was not returned by configure_optimizers, so ZeRO has not sharded it"
            ) from None

    def _broadcast_buffers(self, module: nn.Module, _args: tuple) -> None:
        if module.training and torch.is_grad_enabled():
            self.comms.broadcast_(_floating_buffers(module))

    def grad_buffers(self) -> list[torch.Tensor]:
        return self.reducer.grad_buffers()

    def rebind_shards(self) -> None:
        """Point every shard at the owned rows of its full parameter again, after the module moved (e.g. to CPU)."""
        with torch.no_grad():
            for shard in self.shards:
                shard.local.data = shard.spec.local_view(shard.full.detach())

    def remove(self) -> None:
        self.reducer.remove()
        if self._buffer_hook is not None:
            self._buffer_hook.remove()
            self._buffer_hook = None


def sync_module_states(module: nn.Module, comms: Collectives) -> None:
    """Give every rank rank 0's parameters and buffers, as DDP does when it wraps a module."""
    tensors: Iterable[torch.Tensor] = [p.detach() for p in module.parameters()] + list(module.buffers())
    comms.broadcast_([t for t in tensors if t.numel() > 0])


def _floating_buffers(module: nn.Module) -> list[torch.Tensor]:
    return [b for b in module.buffers() if b.is_floating_point() and b.numel() > 0]
