"""Optimizer offload: the fp32 master shards and the optimizer states live off the training device, and the step runs
on the host (ZeRO-Offload).

[Note: one offloaded step]
Between steps the device holds what compute needs: the working parameters (stages 1-2: full; stage 3: this rank's
rows, ``ParamShard.working``, or none with ``offload_params``) and the reduced gradient shards; the host holds the
fp32 masters (``ParamShard.local``) and, created there by the optimizer itself, its states: for Adam in mixed
precision 2Ψ + 2Ψ/N on the device and 12Ψ/N on the host (fp32: 4Ψ + 4Ψ/N and 12Ψ/N). At the step, after the global
norm and the clip factor are agreed on the device as without offload:

1. every gradient shard is copied to a pinned host buffer at once, on a side stream (CUDA), in its own dtype;
2. group by group (``bucket_mb`` of parameters; with disk offload, a sub-group whose states are read back first),
   the host waits for that group's copy, makes fp32 gradients (times the clip factor), runs the user's optimizer on
   that group alone, and casts the updated masters to the working dtype into pinned buffers, whose copy to the
   device starts at once on the side stream: the copies of later groups overlap the host step of earlier ones;
3. the training stream waits for the last copy, then stages 1-2 all-gather the updated rows as usual.

The optimizer runs torch's fused CPU kernel when its class has one (Adam, AdamW, SGD, Adagrad) and the user did not
ask for another implementation: measured on one H200 machine's 16 host cores for 1.3B parameters, fused AdamW takes
231 ms, foreach 1,093 ms (shared/gpu/README.md); on this project's 2 cores, 112 ms against 724 ms for 32M.
Without a CUDA device everything above is the same code with plain (synchronous) copies: the pipeline, the
placement and the numbers are what a GPU run gets, only the transfers are free; and step 1 stages nothing, as the
gradient shards already live in host memory: each group makes its fp32 gradients straight from them, so a CPU run
does not hold a second copy of every gradient shard (measured in benchmarks/offload_rss.py: wΨ/N less peak RSS).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.optimizer import ShardedOptimizer

#: Optimizer classes with a fused CPU kernel in torch (``fused=True``).
_FUSED_ON_CPU = ("Adam", "AdamW", "SGD", "Adagrad")


class HostOffload:
    """Keeps ``shards``' masters in host memory and runs the step there (see [Note: one offloaded step]).

    ``stage``: stages 1-2 write the updated rows into the full parameter's own rows (then all-gathered); stage 3
    into a device-side working shard, or, with ``params_on_host``, a pinned host one the unit gathers read.
    """

    def __init__(self, shards: Sequence[ParamShard], stage: int, group_bytes: int, params_on_host: bool = False):
        self.shards = list(shards)
        self.group_bytes = group_bytes
        device = self.shards[0].device if self.shards else torch.device("cpu")
        self.pinned = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.pinned else None
        self._grad_staging: dict[ParamShard, Tensor] = {}
        self._row_staging: dict[ParamShard, Tensor] = {}
        with torch.no_grad():
            for shard in self.shards:
                self._move_to_host(shard, stage, params_on_host)

    def _move_to_host(self, shard: ParamShard, stage: int, params_on_host: bool) -> None:
        master = self._host_empty(shard.spec.local_shape, torch.float32 if shard.dtype.is_floating_point else shard.dtype)
        master.copy_(shard.local)
        if stage < 3:
            shard.working = shard.spec.local_view(shard.param.detach())
        elif params_on_host:
            shard.working = self._host_empty(shard.spec.local_shape, shard.dtype).copy_(shard.local)
        else:
            shard.working = shard.local.to(shard.dtype, copy=True)
        shard.local = master
        if shard.sharded:
            shard.to_sharded()  # stage 3: the parameter now holds the working shard

    def _host_empty(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pinned)

    @staticmethod
    def use_fused_kernels(optimizer: torch.optim.Optimizer) -> None:
        """Step on the host with torch's fused CPU kernel, unless the user chose an implementation."""
        if type(optimizer).__name__ not in _FUSED_ON_CPU or "fused" not in optimizer.defaults:
            return
        for group in [optimizer.defaults, *optimizer.param_groups]:
            if not group.get("fused") and not group.get("foreach") and not group.get("differentiable"):
                group["fused"], group["foreach"] = True, False

    # ----------------------------------------------------------------------------------------------------- a step

    @torch.no_grad()
    def update(
        self, sharded: ShardedOptimizer, stepped: list[ParamShard], factor: float, clip_value: float | None,
        **kwargs: Any,
    ) -> Any:
        """Steps 1-3 of [Note: one offloaded step] for the shards of ``sharded`` that have a reduced gradient."""
        arrived = self._fetch_grads(stepped)
        output = None
        groups = list(self.groups(stepped))
        self._begin(sharded, groups)
        for index, group in enumerate(groups):
            with self.resident(index):
                arrived.wait()
                grads = [self._host_grad(s) for s in group]
                if factor != 1.0:
                    torch._foreach_mul_(grads, factor)
                if clip_value is not None:
                    torch._foreach_clamp_min_(grads, -clip_value)
                    torch._foreach_clamp_max_(grads, clip_value)
                output = sharded.update(list(zip(group, grads)), only=group, **kwargs)
                self.push(group)
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        return output

    def groups(self, shards: list[ParamShard]) -> Iterator[list[ParamShard]]:
        """Consecutive groups of about ``group_bytes`` of parameters."""
        group: list[ParamShard] = []
        size = 0
        for shard in shards:
            group.append(shard)
            size += shard.spec.local_numel * shard.local.element_size()
            if size >= self.group_bytes:
                yield group
                group, size = [], 0
        if group:
            yield group

    def _begin(self, sharded: ShardedOptimizer, groups: list[list[ParamShard]]) -> None:
        """Before the groups of a step are walked (disk offload starts reading ahead)."""

    @contextmanager
    def resident(self, index: int) -> Iterator[None]:
        """Group ``index``'s masters and optimizer states are in host memory while inside (always, here)."""
        yield

    @contextmanager
    def staged(self, shards: list[ParamShard]) -> Iterator[None]:
        """While a unit's all-gather packs ``shards``' working rows (host memory: nothing to do)."""
        yield

    def close(self, optimizers: tuple[torch.optim.Optimizer, ...] = ()) -> None:
        """Nothing to remove."""

    def _fetch_grads(self, shards: list[ParamShard]) -> _Arrival:
        """Start copying every gradient shard to a pinned host buffer (step 1; without CUDA, nothing to copy)."""
        if self.stream is None:
            return _Arrival(None)
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            for shard in shards:
                grad = shard.param.grad
                self._staging(self._grad_staging, shard, grad.dtype).copy_(grad, non_blocking=True)
        return _Arrival(self.stream)

    def _host_grad(self, shard: ParamShard) -> Tensor:
        """``shard``'s gradient in fp32 on the host, for the optimizer to consume (and the clip to scale in place):
        from its staging buffer on CUDA; without CUDA a copy made from the gradient itself, one group at a time."""
        if self.stream is not None:
            return self._grad_staging[shard].float()
        return shard.param.grad.to(torch.float32, copy=True)

    def _staging(self, buffers: dict[ParamShard, Tensor], shard: ParamShard, dtype: torch.dtype) -> Tensor:
        """A persistent (pinned, on CUDA) host buffer of ``shard``'s local shape."""
        buffer = buffers.get(shard)
        if buffer is None or buffer.dtype != dtype:
            buffer = buffers[shard] = self._host_empty(shard.spec.local_shape, dtype)
        return buffer

    def push(self, group: list[ParamShard]) -> None:
        """Cast the masters of ``group`` to the working dtype on the host and copy them where the gathers read them
        (after each group's update, and after a checkpoint was loaded into the masters)."""
        with torch.cuda.stream(self.stream) if self.stream is not None else _nothing():
            for shard in group:
                if shard.working.device.type == "cpu":  # offload_params: the host shard is the destination
                    shard.working.copy_(shard.local)
                else:
                    rows = self._staging(self._row_staging, shard, shard.dtype)
                    rows.copy_(shard.local)
                    shard.working.copy_(rows, non_blocking=True)
                shard.mark_written()

    def host_buffers(self) -> list[Tensor]:
        """The pipeline's kept host buffers (gradient and row staging), for memory accounting."""
        return [*self._grad_staging.values(), *self._row_staging.values()]


class _Arrival:
    """Waits for the gradient copies of step 1 (a no-op without a CUDA stream)."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._event = None
        if stream is not None:
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


@contextmanager
def _nothing() -> Iterator[None]:
    yield
