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
from lightning_zero.sharding.flat_param import FlatLayout, ParamShard, ShardSpec, group_into_buckets, shard_parameters
from lightning_zero.sharding.grad_hooks import FullGradReducer, GradReducer, ShardGradReducer
from lightning_zero.sharding.optimizer import ShardedOptimizer, gather_into_full
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
        self.working_dtype = working_dtype
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

    def refresh_full_parameters(self) -> None:
        """After the shards were loaded: stages 1 and 2 rebuild the full parameters from them (stage 3 gathers on
        use)."""
        if self.gatherer is None:
            buckets = group_into_buckets(self.shards, self.config.bucket_bytes)
            gather_into_full([(b, FlatLayout([s.spec for s in b])) for b in buckets], self.comms)

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True) -> None:
        """Load full tensors (a DDP or single-device checkpoint) into the shards: each rank copies its own rows."""
        names = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        buffers = {k: v for k, v in self.module.state_dict(keep_vars=True).items() if k not in names}
        expected = names | set(buffers)
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(f"state_dict does not match the model: missing {missing}, unexpected {unexpected}")
        for shard in self.shards:
            value = state_dict.get(shard.name)
            if value is None:
                continue
            if value.shape != shard.spec.shape:
                raise RuntimeError(
                    f"{shard.name}: the state_dict has shape {tuple(value.shape)}, the model {tuple(shard.spec.shape)}"
                )
            shard.local.copy_(shard.spec.local_view(value.contiguous()))
        for name, buffer in buffers.items():
            if name in state_dict and torch.is_tensor(buffer):
                buffer.copy_(state_dict[name])
        self.refresh_full_parameters()

    @property
    def shards_are_views(self) -> bool:
        """fp32 stages 1 and 2: each local shard is a view of its full parameter's rows."""
        return self.gatherer is None and self.working_dtype is None

    @torch.no_grad()
    def release(self, device: torch.device) -> None:
        """End of fit: the module gets its full parameters back on ``device`` in the optimizer's precision (the fp32
        masters under mixed precision), bucket by bucket, so the accelerator never holds more than two buckets in
        full; the optimizer keeps its shards, moved to ``device`` as well."""
        if self.gatherer is not None:
            for unit in [self.gatherer.root] + self.gatherer.units:
                unit.detach()
        if self.shards_are_views:
            return  # already full; Lightning moves the module, then ``rebind_views``
        for bucket in group_into_buckets(self.shards, self.config.bucket_bytes):
            for shard in bucket:
                shard.full.data = torch.empty(shard.spec.shape, dtype=shard.local.dtype, device=shard.local.device)
            gather_into_full([(bucket, FlatLayout([s.spec for s in bucket]))], self.comms)
            for shard in bucket:
                shard.full.data = shard.full.data.to(device)
        for shard in self.shards:
            shard.local.data = shard.local.data.to(device)

    def rebind_views(self) -> None:
        """fp32 stages 1 and 2, after the module moved: point each shard at its parameter's rows again."""
        if self.shards_are_views:
            for shard in self.shards:
                shard.local.data = shard.spec.local_view(shard.full.detach())


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
