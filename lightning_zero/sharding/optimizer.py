"""ShardedOptimizer: the user's own torch optimizer, stepping only this rank's shards.

[Note: the user's optimizer object is kept]
``configure_optimizers`` builds an optimizer over the full parameters. Rather than wrapping it in a new class, its
``param_groups`` are re-pointed, in place and in the same order, at the local shard parameters before the first step.
The object the user and their LR schedulers hold stays the optimizer that steps: its class, hyper-parameters and
groups keep working, any ``torch.optim`` class that updates element-wise works (Adam, AdamW, SGD with momentum, ...),
and the per-parameter state it creates is shard-sized. Optimizers whose update depends on a parameter's full shape
(e.g. Shampoo, Muon, Adafactor's factored moments) would see a row block instead and are not supported.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_zero.sharding.collectives import Collectives, Handle
from lightning_zero.sharding.flat_param import FlatLayout, ParamShard, group_into_buckets

#: Parameter buckets all-gathered concurrently after a step.
MAX_IN_FLIGHT = 2


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

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather every updated shard into its full parameter (stages 1 and 2), a bounded number at a time."""
        in_flight: deque[tuple[list[ParamShard], FlatLayout, torch.Tensor, Handle]] = deque()
        for bucket, layout in self._gather_buckets:
            first = bucket[0].full
            buffer = torch.empty(layout.full_numel, dtype=first.dtype, device=first.device)
            own_segment = buffer.view(self.comms.world_size, -1)[self.comms.rank]
            layout.pack_local([s.local for s in bucket], own_segment)
            in_flight.append((bucket, layout, buffer, self.comms.all_gather_(buffer)))
            if len(in_flight) > MAX_IN_FLIGHT:
                _finish_gather(*in_flight.popleft())
        while in_flight:
            _finish_gather(*in_flight.popleft())

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict with every per-element tensor gathered to its parameter's full shape.

        It has the layout of the same optimizer built over the full parameters, so plain DDP, a single device or
        ZeRO at any world size can load it. Every rank must call this (it communicates).
        """
        state_dict = self.optimizer.state_dict()
        for index, shard in enumerate(self.shards):
            for key, value in state_dict["state"].get(index, {}).items():
                if _is_per_element(key, value, shard.spec.local_shape, shard):
                    state_dict["state"][index][key] = self._gather_full(value, shard)
        return state_dict

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
                if _is_per_element(key, value, shard.spec.shape, shard):
                    value = shard.spec.local_view(value.contiguous()).clone()
                elif torch.is_tensor(value) and value.dim() > 0:
                    raise ValueError(
                        f"optimizer state {key!r} of parameter {shard.name!r} has shape {tuple(value.shape)}, "
                        f"expected {tuple(shard.spec.shape)}"
                    )
                local_state[index][key] = value
        self.optimizer.load_state_dict({"state": local_state, "param_groups": groups})

    def _gather_full(self, local: torch.Tensor, shard: ParamShard) -> torch.Tensor:
        layout = FlatLayout([shard.spec])
        buffer = torch.empty(layout.full_numel, dtype=local.dtype, device=self.comms.device)
        layout.pack_local([local], buffer.view(self.comms.world_size, -1)[self.comms.rank])
        self.comms.all_gather_(buffer).wait()
        full = torch.empty(shard.spec.shape, dtype=local.dtype, device=self.comms.device)
        layout.unpack(buffer, [full])
        return full.to(local.device)


def _finish_gather(bucket: list[ParamShard], layout: FlatLayout, buffer: torch.Tensor, handle: Handle) -> None:
    handle.wait()
    layout.unpack(buffer, [s.full.detach() for s in bucket])


def _is_per_element(key: str, value: Any, shape: torch.Size, shard: ParamShard) -> bool:
    """Whether an optimizer state entry has one element per parameter element (moments, momentum buffers).

    Judged by shape. A 0-d parameter's moments are 0-d like the scalar ``step`` counter, so that key is excluded.
    """
    if not torch.is_tensor(value) or value.shape != shape:
        return False
    return len(shard.spec.shape) > 0 or key != "step"
