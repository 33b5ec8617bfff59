"""The contracts between the runtime (runtime.py), which owns the step, and the parts it composes per stage.

``ZeroRuntime`` talks to exactly three roles, and only through these methods:

* ``ParameterRole``: keeps the full parameters the forward needs. Stages 1-2: ``ReplicatedParams`` (full parameters,
  rebuilt from the shards after each update); stage 3: ``ShardedParams`` (each unit gathered around its use); world
  size 1: ``SingleRank``.
* ``GradientRole``: reduces each backward's gradients into the shards the optimizer steps. Stages 1-2:
  ``GradReducer``; stage 3: ``ShardedParams`` again (it reduces per unit); world size 1: ``SingleRank``.
* ``Offload``: where the fp32 masters and optimizer states live and the step runs when they are offloaded
  (``lightning_zero.offload``: ``HostOffload``, ``DiskOffload``), handed to the runtime by the strategy.

They are ``typing.Protocol`` classes: the implementations do not inherit from them, a type checker (or a reader)
checks that each provides them.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.grad_hooks import ShardStorage
from lightning_zero.sharding.optimizer import ShardedOptimizer


class ParameterRole(Protocol):
    def begin_step(self) -> None:
        """Before a training or evaluation step (stage 3: gather the root unit)."""

    def reading_guard(self) -> AbstractContextManager[Any]:
        """Around ``training_step``: parameters whose gather is still in flight complete before they are read."""

    def wait(self) -> None:
        """Every parameter holds its current values when this returns."""

    def after_update(self, stepped: Sequence[ParamShard], defer: bool = False) -> None:
        """The shards an optimizer just stepped reach the full parameters (``defer``: may complete on use)."""

    def end_step(self) -> None:
        """After the step's last backward, or an evaluation step (stage 3: free what is still gathered)."""

    def gathered(self) -> AbstractContextManager[Any]:
        """Full parameters while inside (``gathered_parameters``)."""

    def kept_buffers(self) -> list[Tensor]:
        """Buffers kept between collectives, for memory accounting."""

    def remove(self) -> None:
        """Remove every hook (end of fit)."""


class GradientRole(Protocol):
    def pre_backward(self) -> None:
        """Before every backward."""

    def post_backward(self) -> None:
        """After every backward: reduce what is left and wait for it."""

    def no_sync(self) -> AbstractContextManager[Any]:
        """Gradient accumulation between optimizer steps."""

    def grad_buffers(self) -> list[Tensor]:
        """Persistent gradient shard storage, for memory accounting."""

    def remove(self) -> None:
        """Remove every hook (end of fit)."""


class Offload(Protocol):
    """Masters and optimizer states off the training device, and the step that runs where they are (see [Note: one
    offloaded step] in offload/host.py)."""

    def update(self, sharded: ShardedOptimizer, stepped: list[ParamShard], factor: float, clip_value: float | None,
               **kwargs: Any) -> Any:
        """Step ``sharded``'s shards that have a reduced gradient, times ``factor``, clamped to ``clip_value``."""

    def refresh(self) -> None:
        """The masters were loaded: write them where the gathers read them, and make the device wait for that."""

    def staged(self, shards: list[ParamShard]) -> AbstractContextManager[list[Tensor] | None]:
        """Around packing ``shards`` for a unit's all-gather: the tensors to pack (``None``: their gather source)."""

    def use_fused_kernels(self, optimizer: torch.optim.Optimizer) -> None:
        """Say that ``optimizer`` steps with torch's fused host kernel where the user chose none (for the step only)."""

    def grad_storage(self) -> ShardStorage | None:
        """Where gradient shards live (``None``: in memory)."""

    def write_master(self, shard: ParamShard, rows: Tensor) -> None:
        """Load ``rows`` into ``shard``'s master."""

    def keep_state_rows(self, rows: Tensor) -> Tensor:
        """Keep this rank's rows of a loaded optimizer state where offloaded states live."""

    def full_parameter(self, tensor: Tensor, device: torch.device) -> Tensor:
        """Where the end of fit keeps a full parameter just gathered."""

    def check_files(self) -> None:
        """Before a checkpoint reads states through their files' mappings: none was truncated."""

    def release_pages(self) -> None:
        """After a checkpoint read or wrote states through their files' mappings: drop their pages."""

    def disk_tensors(self, optimizers: list[torch.optim.Optimizer]) -> list[Tensor]:
        """Every file-backed tensor, for memory accounting."""

    def host_buffers(self) -> list[Tensor]:
        """Host buffers kept for moving data, for memory accounting."""

    def close(self, optimizers: tuple[torch.optim.Optimizer, ...] = ()) -> None:
        """Release everything (end of fit, or after an error)."""
