"""ZeroStrategy: the Lightning hooks of ZeRO; the work is done by :class:`~lightning_zero.sharding.runtime.ZeroRuntime`.

It subclasses ``DDPStrategy`` for what a data-parallel strategy shares (launchers, cluster environments, process
group, ``barrier``/``broadcast``/``reduce``, the distributed sampler) and overrides every place where DDP assumes a
``DistributedDataParallel`` wrapper: the module is never wrapped, hooks on its parameters do the communication.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.config import SUPPORTED_STAGES, ZeroConfig
from lightning_zero.memory import ModelStateBytes, model_state_bytes
from lightning_zero.sharding.collectives import Collectives, CommStats
from lightning_zero.sharding.runtime import ZeroRuntime, sync_module_states

_START_METHODS = {"": "popen", "_spawn": "spawn", "_fork": "fork", "_notebook": "fork"}


class ZeroStrategy(DDPStrategy):
    """ZeRO data parallelism: ``stage`` 1 shards optimizer states, 2 also gradients (see :class:`ZeroConfig`).

    Use ``Trainer(strategy="zero2")`` (also ``"zero1"``, and ``_fork``/``_spawn``/``_notebook`` variants with that
    start method) after ``import lightning_zero``, or pass an instance for full control::

        Trainer(strategy=ZeroStrategy(stage=2, bucket_mb=50), accelerator="cuda", devices=8)
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        bucket_mb: float = 25.0,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.config = ZeroConfig(
            stage=stage,
            bucket_mb=bucket_mb,
            broadcast_buffers=broadcast_buffers,
            find_unused_parameters=find_unused_parameters,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._runtime: ZeroRuntime | None = None
        self._comm_stats = CommStats()

    @property
    def comm_stats(self) -> CommStats:
        """Bytes moved by every collective this strategy issued on this rank (see ``collectives.py``)."""
        return self._comm_stats

    @property
    def runtime(self) -> ZeroRuntime | None:
        """The sharding runtime of the current fit (``None`` outside ``fit``)."""
        return self._runtime

    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes of parameters, gradients and optimizer states this rank holds now, counted from the tensors."""
        assert self.lightning_module is not None
        extra = self._runtime.grad_buffers() if self._runtime is not None else []
        return model_state_bytes(self.lightning_module, self.optimizers, extra_grad_buffers=extra)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        _check_precision(self.precision_plugin)
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        comms = self._collectives()
        sync_module_states(self.model, comms)
        if trainer.state.fn == TrainerFn.FITTING:
            self._runtime = ZeroRuntime(self.model, self.config, comms)
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                self._runtime.shard_optimizer(optimizer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _collectives(self) -> Collectives:
        comms = Collectives()
        comms.stats = self._comm_stats
        return comms

    @override
    def configure_ddp(self) -> None:
        raise RuntimeError("ZeroStrategy never wraps the module in DistributedDataParallel")

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: stage 1 defers reduction to the boundary; stage 2 reduces into its shards."""
        if self._runtime is None:
            yield
            return
        reducer = self._runtime.reducer
        reducer.sync = False
        try:
            yield
        finally:
            reducer.sync = True

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._runtime is not None:
            self._runtime.reducer.prepare_backward()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self._runtime is not None:
            self._runtime.reducer.finish(backward_ran=True)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if self._runtime is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        sharded = self._runtime.sharded(inner)
        reducer = self._runtime.reducer

        def closure_then_reduce() -> Any:
            result = closure()
            # A backward run outside Lightning's (e.g. a bare ``loss.backward()``) has not been finished yet.
            reducer.finish(backward_ran=False)
            return result

        output = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        sharded.gather_params()
        return output

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state, gathered from the shards (all ranks take part; rank 0 writes it)."""
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if self._runtime is None:
            return inner.state_dict()
        return self._runtime.sharded(inner).consolidated_state_dict()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._runtime is None:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            self._runtime.sharded(optimizer).load_consolidated_state_dict(state)
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def teardown(self) -> None:
        """Remove the hooks; keep the sharded optimizers, so that a checkpoint saved after ``fit`` is still complete.

        After ``fit`` every rank holds the full, trained parameters in the LightningModule (stages 1 and 2).
        """
        if self._runtime is not None:
            self._runtime.remove()
        super().teardown()
        if self._runtime is not None:
            self._runtime.rebind_shards()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for stage in SUPPORTED_STAGES:
            for suffix, start_method in _START_METHODS.items():
                strategy_registry.register(
                    f"zero{stage}{suffix}",
                    cls,
                    description=f"ZeRO stage {stage} with start_method '{start_method}'",
                    stage=stage,
                    start_method=start_method,
                )


def _check_precision(plugin: Precision) -> None:
    if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
        raise ValueError(
            "precision='16-mixed' needs fp16 loss scaling agreed across shards, which ZeroStrategy does not have yet; "
            "use precision='bf16-mixed' or '32-true'"
        )
