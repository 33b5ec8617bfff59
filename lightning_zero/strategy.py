"""ZeroStrategy: the Lightning hooks of ZeRO; the work is done by :class:`~lightning_zero.sharding.runtime.ZeroRuntime`.

It subclasses ``DDPStrategy`` for what a data-parallel strategy shares (launchers, cluster environments, process
group, ``barrier``/``broadcast``/``reduce``, the distributed sampler, ``sync_batchnorm``) and overrides every place
where DDP assumes a ``DistributedDataParallel`` wrapper: the module is never wrapped, hooks on its parameters do the
communication. Each hook below delegates: the step to the runtime, checkpoints to ``checkpoint/``, offload to
``offload/`` (made here, handed to the runtime), large-model init to ``materialize.py``, what Lightning features need
at setup to ``lightning_compat.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint.hooks import ShardedCheckpointHooks
from lightning_zero.config import SUPPORTED_STAGES, ZeroConfig, option_defaults
from lightning_zero.config_checks import check_launch_settings, refuse_on_device
from lightning_zero.evaluation_hooks import EvaluationHooks
from lightning_zero.failure_hooks import FailureHooks
from lightning_zero.host_math import settle_mkl_dispatch
from lightning_zero.lightning_compat import (
    apply_activation_checkpointing,
    mark_sharded_for_transformers,
    refuse_accelerator,
    refuse_unsupported,
    user_code_sees_gradients,
)
from lightning_zero.memory import (
    ModelStateBytes,
    give_back_freed_memory,
    model_state_bytes,
    restore_glibc_heap,
)
from lightning_zero.memory_policy import before_steps, lean_config
from lightning_zero.offload import make_offload
from lightning_zero.precision import ZeroPrecision, as_zero_precision
from lightning_zero.replicas import check_replicas
from lightning_zero.sharded_callbacks import adapt_weight_callbacks
from lightning_zero.sharding.joined_reads import JoinedReads
from lightning_zero.sharding.collectives import Collectives, CommStats, topology_collectives
from lightning_zero.sharding.process_groups import is_initialized, started_world
from lightning_zero.sharding.materialize import (
    LoadsOnMeta,
    generator_state,
    has_meta_tensors,
    materialize_shards,
    rng_state,
)
from lightning_zero.sharding.overlap import install_gate
from lightning_zero.sharding.runtime import ZeroRuntime, sync_module_states
from lightning_zero.sharding.topology import Topology, launched_node_size
from lightning_zero.watchdog import Watchdog

_START_METHODS = {"": "popen", "_spawn": "spawn", "_fork": "fork", "_notebook": "fork"}
#: Registered offload variants: name suffix -> (stages, options).
_OFFLOAD_VARIANTS = {
    "_offload": ((1, 2, 3), {"offload_optimizer": "cpu"}),
    "_offload_disk": ((3,), {"offload_optimizer": "disk", "offload_params": "disk"}),
}


class ZeroStrategy(ShardedCheckpointHooks, EvaluationHooks, FailureHooks, DDPStrategy):
    """ZeRO data parallelism: ``stage`` 1 shards optimizer states, 2 also gradients, 3 also parameters.

    Use ``Trainer(strategy="zero3")`` (also ``"zero1"``, ``"zero2"``, and ``_fork``/``_spawn``/``_notebook`` variants
    with that start method) after ``import lightning_zero``, or pass an instance for full control: either a
    :class:`~lightning_zero.config.ZeroConfig` or its options as keyword arguments (``ZeroConfig.from_options``)::

        Trainer(strategy=ZeroStrategy(stage=3, units=["Block"], prefetch=2), accelerator="cuda", devices=8)

    Under stage 3, a model built in ``configure_model()`` or ``Trainer.init_module()`` is created on the meta device
    and materialized shard by shard (see ``sharding/materialize.py``). After ``fit`` the LightningModule holds the
    full trained weights on every rank, on the CPU, as with DDP; during ``fit``,
    ``with trainer.strategy.gathered_parameters():`` makes them whole for user code.
    """

    strategy_name = "zero"

    def __init__(
        self,
        config: ZeroConfig | None = None,
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **options: Any,
    ) -> None:
        if isinstance(config, int):  # ZeroStrategy(3): the stage, positionally
            options["stage"], config = config, None
        if config is not None and options:
            raise TypeError(f"ZeroStrategy takes a ZeroConfig or options, not both (got {sorted(options)})")
        self.config = config if config is not None else ZeroConfig.from_options(**options)
        check_launch_settings(start_method, process_group_backend, timeout)
        refuse_accelerator(accelerator)
        self._default_precision = ZeroPrecision()
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
        self._comms: tuple[Any, Collectives] | None = None
        self._init_rng_state: Tensor | int | None = None
        #: ``load_state_dict`` on a model built under ``Trainer.init_module()`` (stage 3: on the meta device).
        self._meta_loads = LoadsOnMeta()
        self._failed = False
        self._communicating = False
        self._watchdog: Watchdog | None = None

    @classmethod
    def option_names(cls) -> list[str]:
        """The keyword arguments the strategy takes: ZeRO's options, then the launch settings."""
        return [*option_defaults(), "start_method", "process_group_backend", "timeout"]

    @property
    @override
    def precision_plugin(self) -> ZeroPrecision:
        # Left unset until the Trainer assigns one for its ``precision`` flag (a set plugin would override the flag).
        return self._precision_plugin if self._precision_plugin is not None else self._default_precision

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning assigns the plugin for the user's flag, or the user's own: made ours now, so a bad one fails early.
        self._precision_plugin = None if plugin is None else as_zero_precision(plugin)

    @property
    @override
    def accelerator(self) -> pl.accelerators.Accelerator | None:
        return self._accelerator

    @accelerator.setter
    @override
    def accelerator(self, accelerator: pl.accelerators.Accelerator | None) -> None:
        refuse_accelerator(accelerator)  # before Lightning hands over the XLA accelerator's precision plugin
        self._accelerator = accelerator

    @property
    def runtime(self) -> ZeroRuntime:
        """The sharding of the LightningModule, from the first setup on (kept after ``fit`` for evaluation and
        checkpoints)."""
        if self._runtime is None:
            raise RuntimeError("ZeroStrategy is not set up yet: the runtime exists once the Trainer ran setup")
        return self._runtime

    @property
    def last_grad_norm(self) -> Tensor | None:
        """Global gradient norm (all shards) before the last clip by norm: what DDP's ``clip_grad_norm_`` returns."""
        return self._runtime.last_grad_norm if self._runtime is not None else None

    @property
    def comm_stats(self) -> CommStats:
        """Bytes moved by every collective this strategy issued on this rank (see ``collectives.py``): ``total_bytes``,
        and ``cross_group_bytes``, what this rank sent to other nodes (see [Note: what crosses nodes] in
        sharding/topology.py)."""
        return self._comm_stats

    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes of parameters, gradients and optimizer states this rank holds now, counted from the tensors."""
        assert self.lightning_module is not None
        return model_state_bytes(self.lightning_module, self.optimizers, **self.runtime.held_tensors())

    # ---------------------------------------------------------------------------------------------------- setup

    @override
    def setup_environment(self) -> None:
        initialized = is_initialized()
        super().setup_environment()
        if not initialized and is_initialized():  # Lightning's setup made it: destroyed at exit, as DDP's on NCCL
            started_world()  # see [Note: tearing down at exit] in sharding/process_groups.py
        settle_mkl_dispatch()  # before any optimizer step on the host (host_math.py)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self._communicating = False
        refuse_unsupported(self.model)
        refuse_on_device(self.config.stage3.buffer_pool_mb, self.root_device)
        self.topology()  # a shard_group_size or node_size that does not divide the world fails here, on every rank
        self._communicating = True  # from here on an error may leave collectives without a counterpart
        self._start_watchdog()
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            if self.root_device.type == "cpu":
                raise ValueError("SyncBatchNorm layers only work with GPU modules")  # as DistributedDataParallel
            self.model = self._layer_sync.apply(self.model)
        apply_activation_checkpointing(self.model, self.config.activation_checkpointing_policy)
        if self.config.stage == 3 and self.world_size > 1:
            mark_sharded_for_transformers(self.model)
        comms = self._collectives()
        config = lean_config(self.config, self.model, comms, self.precision_plugin.precision, self.num_processes)
        materialized = None
        if self.config.stage == 3 and has_meta_tensors(self.model):
            # Every rank draws rank 0's numbers, even if the user never seeded.
            recorded = self._init_rng_state if self._init_rng_state is not None else rng_state(self.root_device)
            state = generator_state(self.root_device, recorded).clone().to(comms.device)
            comms.world.broadcast_([state], "the random generator state for meta-device init")
            materialized = materialize_shards(self.model, self.root_device, state.cpu(), comms.rank, comms.world_size,
                                              self._meta_loads.values)
            self._meta_loads.release()
        self.model_to_device()
        sync_module_states(self.model, comms.world)
        previous = self._runtime
        offload = None
        if self.config.offload.offload_optimizer:
            offload = partial(make_offload, config=self.config, comms=comms, host_ranks=self.num_processes)
        working_dtype = self.precision_plugin.working_dtype
        self._runtime = ZeroRuntime(self.model, config, comms, working_dtype, materialized, offload, self._timeout)
        del materialized  # the rows the shards were cut from: the shards own them now
        self._runtime.user_view.keep_norms = fitting and user_code_sees_gradients(trainer)
        if not self._runtime.single_rank:  # see [Note: a read that runs on one rank] in sharding/joined_reads.py
            self._runtime.user_view.reads = JoinedReads.open(self._timeout, self._watchdog)
        if self.config.stage == 3 and not self._runtime.single_rank:
            adapt_weight_callbacks(trainer, self._runtime, self.gathered_parameters)
        give_back_freed_memory()
        before_steps(config, comms)
        if fitting:
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                self._runtime.shard_optimizer(optimizer)
        elif previous is not None:  # evaluation after fit: the fit's optimizers stay saveable
            for sharded in previous.optimizers.values():
                self._runtime.shard_optimizer(sharded.optimizer)
        self.setup_precision_plugin()
        if fitting and self._runtime.offload is None:  # offloaded optimizer states stay on the host
            _optimizers_to_device(self.optimizers, self.root_device)
        if self.config.stage != 3 and not self._runtime.single_rank:
            install_gate(trainer, self._runtime)  # user hooks wait for the gathers overlapping the next forward
        self._failed = False

    def topology(self) -> Topology:
        """Which ranks shard together and which share a node (see [Note: hybrid sharding] and [Note: nodes from the
        launcher] in sharding/topology.py); raises, naming the option, unless ``shard_group_size`` and ``node_size``
        divide the world size, or when the launcher's nodes disagree with the Trainer's ``num_nodes``."""
        options = self.config.topology
        environment = self.cluster_environment
        external = environment is not None and environment.creates_processes_externally
        host_ranks = launched_node_size(os.environ, external, self.num_processes, self.num_nodes, self.world_size)
        return Topology.make(self.world_size, self.global_rank, options.shard_group_size, options.node_size,
                             host_ranks=host_ranks, hpz_group_size=options.hpz_group_size)

    def _collectives(self) -> Collectives:
        """The runtime's collectives over the world; under hybrid sharding over the shard group (with hpZ, and its
        groups), made at the first setup (its process groups are created once, every rank creating them in the same
        order) and kept for the setups after it (evaluation after fit)."""
        topology = self.topology()
        if not topology.needs_groups:
            return topology_collectives(self.root_device, topology, self.config.comm.shortcut_single_rank,
                                        self._comm_stats)
        key = (self.root_device, topology)
        if self._comms is None or self._comms[0] != key:
            comms = topology_collectives(self.root_device, topology, self.config.comm.shortcut_single_rank,
                                         self._comm_stats)
            self._comms = (key, comms)
        return self._comms[1]

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Stage 3 builds modules on the meta device; setup materializes only the local shards. Runs in the launching
        process under ``Trainer.init_module()``, which must not initialize CUDA (Lightning forks the ranks from it
        with ``start_method="fork"``): the generator is recorded without initializing it (``rng_state``)."""
        if self.config.stage != 3:
            with super().tensor_init_context(empty_init):
                yield
            return
        self._init_rng_state = rng_state(self.root_device)
        with torch.device("meta"), self.precision_plugin.tensor_init_context(), self._meta_loads.watching():
            yield

    @contextmanager
    def gathered_parameters(self) -> Generator[None, None, None]:
        """Full parameters in the LightningModule for user code during ``fit`` (generation, export, inspection).

        Every rank must enter it. Under stage 3 it gathers every unit (the whole model, on each rank) and frees them
        again on exit. In-place changes made inside (under ``torch.no_grad()``) are kept: each rank writes its rows
        back into its shards. Stages 1 and 2 always hold full parameters.
        """
        with self.runtime.gathered():
            yield

    @contextmanager
    def gathered_gradients(self) -> Generator[None, None, None]:
        """Plain full gradients in ``p.grad`` for user code that needs every value (histograms, export), where
        ``p.grad`` is otherwise a ``ShardedGrad`` (see [Note: a sharded gradient answers as the full one]). Every
        rank must enter it; edits made inside are kept. Costs one all-gather of the gradients and their full size
        in memory while inside."""
        with self.runtime.gathered_gradients():
            yield

    def check_replicas(self) -> int:
        """Check that every rank holds the same full parameters (stage 3: as gathered) and floating-point buffers,
        by exchanging a CRC-32 of each; raise ``ReplicaMismatchError`` on every rank naming the tensors that differ,
        else return how many were compared. Costs hashing the model on the host (and, under stage 3, one gather of
        it): a debugging and testing aid, not for every step. Every rank must call it."""
        with self.gathered_parameters():
            return check_replicas(self.model, self.runtime.comms.world)

    def grad_norm(self, norm_type: float = 2.0, group_separator: str = "/") -> dict[str, float]:
        """Use in ``on_before_optimizer_step`` instead of Lightning's ``grad_norm(module, norm_type)``, which sees only
        this rank's gradient shards here: the same dictionary (each parameter's whole-gradient norm and the total),
        computed over every rank's shards. Every rank must call it."""
        return self.runtime.grad_norm(norm_type, group_separator)

    @override
    def configure_ddp(self) -> None:
        raise RuntimeError("ZeroStrategy never wraps the module in DistributedDataParallel")

    # ----------------------------------------------------------------------------------------------------- steps

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.runtime.begin_step(training=True, fitting=True)
        with self.runtime.reading_guard():  # stage 1/2: parameters still being gathered complete on first read
            return super().training_step(*args, **kwargs)

    @override
    def post_training_step(self) -> None:
        """Manual optimization ran its backward passes inside ``training_step``: the step is over; so is a step
        whose backward Lightning skips (``StochasticWeightAveraging``'s BatchNorm epoch: forwards only)."""
        super().post_training_step()
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization or module.trainer.fit_loop._skip_backward:
            self.runtime.end_step()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: stage 1 defers reduction to the boundary; stages 2 and 3 reduce into shards."""
        with self.runtime.no_sync():
            yield

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward, with the reductions completed before ``on_after_backward`` (which the precision
        plugin's ``post_backward`` calls) rather than after it: user code there sees the averaged gradients, as
        under DDP (see [Note: what user code sees of a parameter and its gradient])."""
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.precision_plugin.backward(closure_loss, self.lightning_module, optimizer, *args, **kwargs)
        self.post_backward(closure_loss)
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self.runtime.pre_backward()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self.runtime.post_backward()
        assert self.lightning_module is not None
        if self.lightning_module.automatic_optimization:
            self.runtime.end_step()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule)
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        plugin = self.precision_plugin

        def closure_with_hooks() -> Any:
            unscale = partial(self.runtime.unscale_for_hooks, inner, plugin.scaler)
            return plugin.closure_with_hooks(model, optimizer, closure, before_hooks=unscale)

        # Gathers may stay in flight into the next forward unless user code runs right after the step: manual
        # optimization, or an overridden ``LightningModule.optimizer_step`` (see sharding/overlap.py).
        defer = model.automatic_optimization and not is_overridden("optimizer_step", model, parent=pl.LightningModule)
        return self.runtime.step(inner, closure_with_hooks, plugin, model.automatic_optimization, defer, **kwargs)

    # -------------------------------------------------------------------------------------------------- teardown

    @override
    def teardown(self) -> None:
        """Give the LightningModule its full trained parameters back, on the CPU, in the optimizer's precision
        (stage 3 gathers them bucket by bucket); keep the sharded optimizers, so that a checkpoint saved after
        ``fit`` is still complete. After an error nothing is gathered (a collective could wait on a rank that is
        not coming), and a model setup left on the meta device stays there: the first error is the one to see."""
        try:
            if self._runtime is not None and not self._runtime.released:
                self._runtime.release(torch.device("cpu"), gather=not self._failed)
            if self._runtime is not None and not self._failed:  # after a failure a relay may wait on a dead peer
                self._runtime.comms.close()
            module = self.lightning_module
            if module is not None and has_meta_tensors(module):
                self.precision_plugin.teardown()
                self.accelerator.teardown()
                return
            super().teardown()
        finally:
            self._stop_watchdog()
            restore_glibc_heap()  # the run's mallopt settings are the process's (memory.py)

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
        for suffix, (stages, options) in _OFFLOAD_VARIANTS.items():
            for stage in stages:
                strategy_registry.register(
                    f"zero{stage}{suffix}", cls, description=f"ZeRO stage {stage} with {options}", stage=stage, **options
                )
