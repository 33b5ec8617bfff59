"""ZeroStrategy: the Lightning hooks of ZeRO; the work is done by :class:`~lightning_zero.sharding.runtime.ZeroRuntime`.

It subclasses ``DDPStrategy`` for what a data-parallel strategy shares (launchers, cluster environments, process
group, ``barrier``/``broadcast``/``reduce``, the distributed sampler) and overrides every place where DDP assumes a
``DistributedDataParallel`` wrapper: the module is never wrapped, hooks on its parameters do the communication.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero import checkpoint as ckpt
from lightning_zero.config import SUPPORTED_STAGES, ZeroConfig
from lightning_zero.memory import ModelStateBytes, model_state_bytes
from lightning_zero.precision import ZeroPrecision, zero_precision_for
from lightning_zero.sharding.collectives import Collectives, CommStats
from lightning_zero.sharding.materialize import has_meta_tensors, materialize_shards, rng_state
from lightning_zero.sharding.runtime import ZeroRuntime, sync_module_states

_START_METHODS = {"": "popen", "_spawn": "spawn", "_fork": "fork", "_notebook": "fork"}


class ZeroStrategy(DDPStrategy):
    """ZeRO data parallelism: ``stage`` 1 shards optimizer states, 2 also gradients, 3 also parameters.

    Use ``Trainer(strategy="zero3")`` (also ``"zero1"``, ``"zero2"``, and ``_fork``/``_spawn``/``_notebook`` variants
    with that start method) after ``import lightning_zero``, or pass an instance for full control (the arguments are
    those of :class:`~lightning_zero.config.ZeroConfig`)::

        Trainer(strategy=ZeroStrategy(stage=3, units=["Block"], prefetch=2), accelerator="cuda", devices=8)

    Under stage 3, a model built in ``configure_model()`` or ``Trainer.init_module()`` is created on the meta device
    and materialized shard by shard (see ``sharding/materialize.py``). After ``fit`` the LightningModule holds the
    full trained weights on every rank, on the CPU, as with DDP; during ``fit``,
    ``with trainer.strategy.gathered_parameters():`` makes them whole for user code.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        bucket_mb: float = 25.0,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        prefetch: int = 1,
        reshard_after_forward: bool = True,
        units: tuple[str, ...] | list[str] = (),
        unit_mb: float = 16.0,
        reduce_dtype: str | None = None,
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
        self._default_precision = ZeroPrecision()
        self.config = ZeroConfig(
            stage=stage,
            bucket_mb=bucket_mb,
            broadcast_buffers=broadcast_buffers,
            find_unused_parameters=find_unused_parameters,
            prefetch=prefetch,
            reshard_after_forward=reshard_after_forward,
            units=tuple(units),
            unit_mb=unit_mb,
            reduce_dtype=reduce_dtype,
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
        self._init_rng_state: Tensor | None = None
        self._device_mesh = None
        self._loaded_sharded = False

    @property
    @override
    def precision_plugin(self) -> ZeroPrecision:
        # Left unset until the Trainer assigns one for its ``precision`` flag (a set plugin would override the flag).
        return self._precision_plugin if self._precision_plugin is not None else self._default_precision

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning assigns its generic plugin for the user's flag; translate it now so a bad flag fails early.
        self._precision_plugin = None if plugin is None else zero_precision_for(plugin)

    @property
    def last_grad_norm(self) -> Tensor | None:
        """Global gradient norm (all shards) before the last clip by norm: what DDP's ``clip_grad_norm_`` returns."""
        return self.precision_plugin.last_grad_norm

    @property
    def comm_stats(self) -> CommStats:
        """Bytes moved by every collective this strategy issued on this rank (see ``collectives.py``)."""
        return self._comm_stats

    @property
    def runtime(self) -> ZeroRuntime | None:
        """The sharding runtime set up by the last ``fit`` (or stage-3 evaluation); ``None`` before."""
        return self._runtime

    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes of parameters, gradients and optimizer states this rank holds now, counted from the tensors."""
        assert self.lightning_module is not None
        extra = self._runtime.grad_buffers() if self._runtime is not None else []
        return model_state_bytes(self.lightning_module, self.optimizers, extra_grad_buffers=extra)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        comms = self._collectives()
        detached = None
        if self.config.stage == 3 and has_meta_tensors(self.model):
            # Every rank draws rank 0's numbers, even if the user never seeded.
            state = (self._init_rng_state if self._init_rng_state is not None else rng_state(self.root_device)).clone()
            comms.broadcast_([state])
            detached = materialize_shards(self.model, self.root_device, state, comms.rank, comms.world_size)
        self.model_to_device()
        sync_module_states(self.model, comms)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting or self.config.stage == 3:
            working_dtype = self.precision_plugin.working_dtype
            self._runtime = ZeroRuntime(self.model, self.config, comms, detached, working_dtype)
        if fitting:
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                self._runtime.shard_optimizer(optimizer)
            self.precision_plugin.sharded = self._runtime.sharded
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Stage 3 builds modules on the meta device; setup materializes only the local shards."""
        if self.config.stage != 3:
            with super().tensor_init_context(empty_init):
                yield
            return
        self._init_rng_state = rng_state(self.root_device)
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def gathered_parameters(self) -> Generator[None, None, None]:
        """Full parameters in the LightningModule for user code during ``fit`` (generation, export, inspection).

        Every rank must enter it. Under stage 3 it gathers every unit (the whole model, on each rank) and frees them
        again on exit; changes made inside are not kept. Stages 1 and 2 always hold full parameters.
        """
        with self._runtime.gathered() if self._runtime is not None else nullcontext():
            yield

    def _collectives(self) -> Collectives:
        comms = Collectives()
        comms.stats = self._comm_stats
        return comms

    @override
    def configure_ddp(self) -> None:
        raise RuntimeError("ZeroStrategy never wraps the module in DistributedDataParallel")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runtime is not None:
            self._runtime.begin_step(training=True)
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().predict_step, *args, **kwargs)

    def _evaluation_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._runtime is None:
            return step(*args, **kwargs)
        self._runtime.begin_step(training=False)
        try:
            return step(*args, **kwargs)
        finally:
            self._runtime.end_step()

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
            self._runtime.end_step()

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
        reducer = self._runtime.reducer

        def closure_then_reduce() -> Any:
            result = closure()
            # A backward run outside Lightning's (e.g. a bare ``loss.backward()``) has not been finished yet.
            reducer.finish(backward_ran=False)
            return result

        output = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        self._runtime.after_optimizer_step(inner)
        return output

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints are loaded into the shards, so after they exist."""
        return True

    def _mesh(self):
        if self._device_mesh is None:
            self._device_mesh = self._collectives().device_mesh()
        return self._device_mesh

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's shards as DTensors, keyed by parameter name: no communication (see ``checkpoint.py``)."""
        assert self.lightning_module is not None
        shards = self._runtime.shards if self._runtime is not None else None
        return ckpt.model_tensors(self.lightning_module, shards, self._mesh() if shards else None)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's optimizer state shards, keyed by parameter name."""
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if self._runtime is None:
            raise RuntimeError("ZeroStrategy has no sharded optimizer outside fit to save the state of")
        return ckpt.optimizer_tensors(self._runtime.sharded(inner), self._mesh())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint directory, every rank in parallel, atomically (see ``checkpoint.py``)."""
        if storage_options is not None:
            raise TypeError("ZeroStrategy writes torch.distributed.checkpoint directories; storage_options is not used")
        assert self.lightning_module is not None
        facts = {"stage": self.config.stage, "world_size": self.world_size, "precision": self.precision_plugin.precision}
        shards = self._runtime.shards if self._runtime is not None else None
        ckpt.save_sharded(filepath, checkpoint, self.lightning_module, shards, facts, self._collectives())

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            ckpt.remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint directory is read straight into the shards, each rank reading only its rows (at any
        world size and stage); a single-file checkpoint (DDP, single device, ``consolidate``) loads as usual."""
        self._loaded_sharded = ckpt.is_sharded_checkpoint(checkpoint_path)
        if not self._loaded_sharded:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        assert self.lightning_module is not None
        runtime = self._runtime
        sharded = [runtime.sharded(o) for o in self.optimizers] if runtime is not None else []
        meta = ckpt.load_sharded(
            checkpoint_path,
            self.lightning_module,
            runtime.shards if runtime is not None else None,
            sharded,
            self._mesh() if runtime is not None else None,
            self._collectives(),
        )
        if runtime is not None:
            runtime.refresh_full_parameters()
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._loaded_sharded:
            return
        if self._runtime is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        self._runtime.load_full_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._loaded_sharded:
            self._loaded_sharded = False
            return
        if self._runtime is None:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            self._runtime.sharded(optimizer).load_consolidated_state_dict(state)
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def teardown(self) -> None:
        """Remove the hooks and give the LightningModule its full trained parameters back, on the CPU, in the
        optimizer's precision (stage 3 gathers them bucket by bucket); keep the sharded optimizers, so that a
        checkpoint saved after ``fit`` is still complete."""
        if self._runtime is not None:
            self._runtime.remove_hooks()
            self._runtime.release(torch.device("cpu"))
        super().teardown()
        if self._runtime is not None:
            self._runtime.rebind_views()

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
