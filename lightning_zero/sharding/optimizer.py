"""ShardedOptimizer: the user's own torch optimizer, stepping only this rank's shards.

[Note: the user's optimizer object is kept]
``configure_optimizers`` builds an optimizer over the full parameters. Rather than wrapping it in a new class, its
``param_groups`` are re-pointed, in place and in the same order, at the local shard parameters before the first step.
The object the user and their LR schedulers hold stays the optimizer that steps: its class, hyper-parameters and
groups keep working, any ``torch.optim`` class that updates element-wise works (Adam, AdamW, SGD with momentum, ...),
and the per-parameter state it creates is shard-sized. Optimizers whose update depends on a parameter's full shape
(e.g. Shampoo, Muon, Adafactor's factored moments) would see a row block instead and are not supported.

The optimizer's ``zero_grad`` is extended (through a subclass made for that one instance, so ``isinstance`` and the
class name are unchanged) to also clear the reduced gradients that the sharding keeps beside ``param.grad`` (see
``ParamShard.grad``).

[Note: gradients at the optimizer step]
The step is where loss scaling, clipping and the precision of the update meet. ``prepare_step`` computes, from the
reduced gradient shards, whether any rank saw an inf/NaN (fp16 loss scaling: one all-reduce of a flag) and the
global gradient norm (one all-reduce of a sum of squares, equal to what ``clip_grad_norm_`` computes on DDP's full
gradients), folds the loss-scale inverse and the clipping coefficient into one factor, and applies it: in place
when the optimizer steps the reduced gradients themselves (fp32), or while making the fp32 copy that an fp32 master
shard needs (16-bit working parameters), a copy that lives only for the step.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_zero.sharding.collectives import MAX_IN_FLIGHT, Collectives, Handle
from lightning_zero.sharding.flat_param import FlatLayout, ParamShard, group_into_buckets



class ShardedOptimizer:
    """Points ``optimizer`` at the local shards of its parameters and all-gathers them after each step."""

    def __init__(
        self, optimizer: Optimizer, shard_of: dict[torch.nn.Parameter, ParamShard], comms: Collectives, bucket_bytes: int
    ) -> None:
        if optimizer.state:
            raise RuntimeError(
                f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} parameters; ZeRO must "
                "shard an optimizer before its first step"
            )
        self.optimizer = optimizer
        self.comms = comms
        self.shards: list[ParamShard] = []
        for group in optimizer.param_groups:
            locals_ = []
            for param in group["params"]:
                shard = shard_of.get(param)
                if shard is None:
                    raise ValueError(
                        f"{type(optimizer).__name__} holds a parameter of shape {tuple(param.shape)} that is not a "
                        "parameter of the LightningModule; ZeRO can only shard the module's own parameters"
                    )
                locals_.append(shard.local)
                self.shards.append(shard)
            group["params"] = locals_
        trainable = [s for s in self.shards if s.trainable]
        self._gather_buckets = [
            (bucket, FlatLayout([s.spec for s in bucket])) for bucket in group_into_buckets(trainable, bucket_bytes)
        ]
        self._wrap_zero_grad()

    def _wrap_zero_grad(self) -> None:
        # A per-instance subclass rather than an instance attribute: Lightning's LightningOptimizer derives its own
        # class from the optimizer's and would otherwise reach the original ``zero_grad`` through its MRO.
        cls = type(self.optimizer)
        shards = self.shards

        def zero_grad(optimizer: Optimizer, set_to_none: bool = True) -> None:
            cls.zero_grad(optimizer, set_to_none)
            for shard in shards:
                shard.clear_grad(set_to_none)

        zero_grad.__doc__ = cls.zero_grad.__doc__
        self.optimizer.__class__ = type(cls.__name__, (cls,), {"zero_grad": zero_grad, "__module__": cls.__module__})

    def found_inf(self) -> bool:
        """Whether any rank's reduced gradients hold an inf or NaN (one all-reduce)."""
        grads = [s.grad for s in self.shards if s.grad is not None and s.grad.numel() > 0]
        flag = torch.zeros(1, device=self.comms.device)
        if grads:
            flag += torch.stack([torch.logical_not(torch.isfinite(g).all()) for g in grads]).any().to(flag.device)
        self.comms.all_reduce_sum_(flag)
        return bool(flag.item() > 0)

    def grad_norm(self, scale: float = 1.0) -> torch.Tensor:
        """Global L2 norm over all ranks' gradient shards (padding excluded), divided by ``scale``."""
        grads = [s.grad for s in self.shards if s.grad is not None and s.grad.numel() > 0]
        total = torch.zeros(1, dtype=torch.float32, device=self.comms.device)
        if grads:
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            total += torch.stack(norms).square().sum().to(total.device)
        self.comms.all_reduce_sum_(total)
        return total.sqrt()[0] / scale

    @torch.no_grad()
    def prepare_step(self, factor: float, clip_value: float | None = None) -> None:
        """Give the optimizer its gradients, multiplied by ``factor`` and clamped to ``clip_value``."""
        for shard in self.shards:
            grad = shard.grad
            if grad is None:
                continue
            if grad.dtype == shard.local.dtype:
                if factor != 1.0:
                    grad.mul_(factor)
                shard.local.grad = grad
            else:
                shard.local.grad = grad.to(shard.local.dtype).mul_(factor)
            if clip_value is not None:
                shard.local.grad.clamp_(-clip_value, clip_value)

    def finish_step(self) -> None:
        """Drop the fp32 gradient copies made for fp32 masters."""
        for shard in self.shards:
            if shard.grad is not None and shard.grad.dtype != shard.local.dtype:
                shard.local.grad = None

    def gather_params(self) -> None:
        """All-gather every updated shard into its full parameter (stages 1 and 2), a bounded number at a time."""
        gather_into_full(self._gather_buckets, self.comms)

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full-shape optimizer state dict (as written by :meth:`consolidated_state_dict` or by DDP)."""
        groups = state_dict["param_groups"]
        saved = sum(len(g["params"]) for g in groups)
        if saved != len(self.shards):
            raise ValueError(
                f"the checkpoint's {type(self.optimizer).__name__} state covers {saved} parameters but this optimizer "
                f"has {len(self.shards)}"
            )
        local_state: dict[int, dict[str, Any]] = {}
        for index, entry in state_dict["state"].items():
            shard = self.shards[int(index)]
            local_state[index] = {}
            for key, value in entry.items():
                if is_per_element(key, value, shard.spec.shape, shard):
                    value = shard.spec.local_view(value.contiguous()).clone()
                elif torch.is_tensor(value) and value.dim() > 0:
                    raise ValueError(
                        f"optimizer state {key!r} of parameter {shard.name!r} has shape {tuple(value.shape)}, "
                        f"expected {tuple(shard.spec.shape)}"
                    )
                local_state[index][key] = value
        self.optimizer.load_state_dict({"state": local_state, "param_groups": groups})

@torch.no_grad()
def gather_into_full(buckets: list[tuple[list[ParamShard], FlatLayout]], comms: Collectives) -> None:
    """Rebuild full parameters from every rank's local shard (cast to the parameters' dtype), bucket by bucket."""
    in_flight: deque[tuple[list[ParamShard], FlatLayout, torch.Tensor, Handle]] = deque()
    for bucket, layout in buckets:
        first = bucket[0].full
        buffer = torch.empty(layout.full_numel, dtype=first.dtype, device=first.device)
        own_segment = buffer.view(comms.world_size, -1)[comms.rank]
        layout.pack_local([s.local for s in bucket], own_segment)
        in_flight.append((bucket, layout, buffer, comms.all_gather_(buffer)))
        if len(in_flight) > MAX_IN_FLIGHT:
            _finish_gather(*in_flight.popleft())
    while in_flight:
        _finish_gather(*in_flight.popleft())


def _finish_gather(bucket: list[ParamShard], layout: FlatLayout, buffer: torch.Tensor, handle: Handle) -> None:
    handle.wait()
    layout.unpack(buffer, [s.full.detach() for s in bucket])


def is_per_element(key: str, value: Any, shape: torch.Size, shard: ParamShard) -> bool:
    """Whether an optimizer state entry has one element per parameter element (moments, momentum buffers).

    Judged by shape. A 0-d parameter's moments are 0-d like the scalar ``step`` counter, so that key is excluded.
    """
    if not torch.is_tensor(value) or value.shape != shape:
        return False
    return len(shard.spec.shape) > 0 or key != "step"
