"""ZeroRuntime: the composition of a stage's parts around one module, for one fit (or evaluation).

Stage 1 is the sharded optimizer plus a reduction of full gradients at the accumulation boundary
(``FullGradReducer``); stage 2 swaps in the reducer that keeps only gradient shards (``ShardGradReducer``); stage 3
keeps that reducer and adds the parameter gatherer of param_hooks.py, with standalone local shards instead of views.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.flat_param import ParamShard, ShardSpec, shard_parameters
from lightning_zero.sharding.grad_hooks import FullGradReducer, GradReducer, ShardGradReducer
from lightning_zero.sharding.optimizer import ShardedOptimizer
from lightning_zero.sharding.param_hooks import ParamGatherer, Unit, free_full_parameter
from lightning_zero.sharding.units import plan_units

_REDUCERS: dict[int, type[GradReducer]] = {1: FullGradReducer, 2: ShardGradReducer, 3: ShardGradReducer}


class ZeroRuntime:
    """Shards ``module``'s parameters, reduces its gradients, gathers them on use (stage 3), shards the optimizers.

    ``detached`` (stage 3 only) gives the full shape and local rows of parameters already freed by large-model init.
    ``working_dtype`` (mixed precision) makes the module's parameters 16-bit and the optimizer's shards fp32 masters.
    """

    def __init__(
        self,
        module: nn.Module,
        config: ZeroConfig,
        comms: Collectives,
        detached: dict[nn.Parameter, tuple[torch.Size, Tensor]] | None = None,
        working_dtype: torch.dtype | None = None,
    ) -> None:
        self.module = module
        self.config = config
        self.comms = comms
        if config.stage == 3:
            detached = _detach_local_rows(module, comms, detached or {})
            named = [(n, p) for n, p in module.named_parameters() if detached[p][0].numel() > 0]
        else:
            named = [(n, p) for n, p in module.named_parameters() if p.numel() > 0]
        master = torch.float32 if working_dtype is not None else None
        self.shards: list[ParamShard] = shard_parameters(named, comms.rank, comms.world_size, detached, master)
        if working_dtype is not None:
            _cast_full_parameters(self.shards, working_dtype)
        self._shard_of = {s.full: s for s in self.shards}
        self.reducer = _REDUCERS[config.stage](
            self.shards,
            comms,
            config.bucket_bytes,
            find_unused_parameters=config.find_unused_parameters,
            reduce_dtype=config.reduce_torch_dtype,
        )
        self.gatherer = self._make_gatherer() if config.stage == 3 else None
        self.optimizers: dict[int, ShardedOptimizer] = {}

    def _make_gatherer(self) -> ParamGatherer:
        root_plan, plans = plan_units(self.module, self.config.units, self.config.unit_bytes)

        def unit(plan) -> Unit:
            return Unit(plan.name, plan.module, [self._shard_of[p] for p in plan.params if p in self._shard_of], self.comms)

        return ParamGatherer(unit(root_plan), [unit(p) for p in plans], self.config.prefetch, self.config.reshard_after_forward)

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

    def begin_step(self, training: bool) -> None:
        """Before a training/evaluation step: buffers from rank 0 (as DDP), the root unit's parameters (stage 3)."""
        if training and self.config.broadcast_buffers:
            self.comms.broadcast_(_floating_buffers(self.module))
        if self.gatherer is not None:
            self.gatherer.begin_step()

    def end_step(self) -> None:
        """After backward, or after an evaluation step: free what stage 3 still holds gathered."""
        if self.gatherer is not None:
            self.gatherer.end_step()

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        """Stages 1 and 2 all-gather the updated shards now; stage 3 gathers them when each unit next runs."""
        if self.gatherer is None:
            self.sharded(optimizer).gather_params()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        with self.gatherer.gathered() if self.gatherer is not None else nullcontext():
            yield

    def grad_buffers(self) -> list[Tensor]:
        return self.reducer.grad_buffers()

    def remove_hooks(self) -> None:
        self.reducer.remove()
        if self.gatherer is not None:
            self.gatherer.remove()

    @torch.no_grad()
    def release(self, device: torch.device) -> None:
        """End of fit: the module gets its full parameters back, on ``device``; the optimizer keeps the shards.

        Stage 3 gathers unit by unit, so the accelerator never holds more than one unit in full.
        """
        if self.gatherer is None:
            for shard in self.shards:
                shard.local.data = shard.spec.local_view(shard.full.detach())
            return
        for unit in [self.gatherer.root] + self.gatherer.units:
            unit.wait_unshard()
            for shard in unit.shards:
                shard.full.data = shard.full.detach().to(device, copy=True)
            unit.detach()
        for shard in self.shards:
            shard.local.data = shard.local.data.to(device)


@torch.no_grad()
def _cast_full_parameters(shards: list[ParamShard], dtype: torch.dtype) -> None:
    """16-bit working parameters; their fp32 values live on in the masters (the local shards)."""
    for shard in shards:
        shard.full.data = shard.full.data.to(dtype)
        if shard.local.dtype != torch.float32:
            shard.local.data = shard.local.data.float()


def _detach_local_rows(
    module: nn.Module, comms: Collectives, given: dict[nn.Parameter, tuple[torch.Size, Tensor]]
) -> dict[nn.Parameter, tuple[torch.Size, Tensor]]:
    """Full shape and a copy of the owned rows of every parameter, whose full tensor is then freed (stage 3)."""
    detached = dict(given)
    for param in module.parameters():
        if param not in detached:
            spec = ShardSpec(param.shape, comms.rank, comms.world_size)
            detached[param] = (param.shape, spec.local_view(param.detach()).clone())
            free_full_parameter(param)
    return detached


def sync_module_states(module: nn.Module, comms: Collectives) -> None:
    """Give every rank rank 0's parameters and buffers, as DDP does when it wraps a module.

    Parameters already sharded by large-model init are empty and skipped: every rank drew the same values.
    """
    tensors = [p.detach() for p in module.parameters()] + list(module.buffers())
    comms.broadcast_([t for t in tensors if t.numel() > 0])


def _floating_buffers(module: nn.Module) -> list[Tensor]:
    return [b for b in module.buffers() if b.is_floating_point() and b.numel() > 0]
