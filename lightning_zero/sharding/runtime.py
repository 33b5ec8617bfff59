"""ZeroRuntime: the sharding of one module, composed per stage, and the one owner of the optimizer step.

Stage 1 is the sharded optimizer, a ``GradReducer`` that keeps full gradients and reduces them at the accumulation
boundary, and ``ReplicatedParams`` (all-gather after the update). Stage 2 swaps in the reducer that keeps only
gradient shards. Stage 3 replaces both with ``ShardedParams`` (param_hooks.py), which gathers each unit around its
forward and backward and reduces per unit. The runtime only talks to these two roles: ``self.gradients`` (before and
after each backward) and ``self.parameters`` (around each step, after each update), and to the offload the strategy
hands it, each through its Protocol in roles.py. At world size 1 both roles are
``SingleRank`` (single_rank.py): no hooks, no copies. Making the shards is shards.py's; the step's arithmetic
(global norm, clip coefficient, loss-scale inverse, non-finite policy) is scaling.py's.

[Note: one optimizer step]
The walk of a zero2 step, from ``training_step`` to the next forward (zero3 differences in brackets):

1. Reduce. ``begin_step`` broadcasts buffers from rank 0 (as DDP) [and gathers the root unit]. The closure runs
   ``training_step`` [each unit's pre-forward hook waits for its all-gather, prefetches the next, the post-forward
   hook frees it] and backward: ``pre_backward`` carries the last gradient shards into it, post-accumulate-grad hooks
   pack each full bucket and launch its reduce-scatter [the unit is gathered again when its outputs' gradients arrive
   and reduced, then freed, once backward is through it], and ``post_backward`` launches the rest and waits.
   Lightning's ``on_before_optimizer_step`` runs here, and records a clip request.
2. Update. ``step`` takes each parameter's reduced gradient shard (fp32 copies under mixed precision), agrees
   across ranks on the global norm with one all-reduce of a sum of squares (unless nothing needs it:
   ``nonfinite_grads="ignore"``, no clipping by norm, no fp16 loss scaling), folds the loss-scale inverse and the
   clip coefficient into one factor on the device (no host synchronisation: [Note: no host synchronisation in a
   step]), and runs the user's optimizer on the local shards. A rank's inf or NaN is seen by every rank through that
   all-reduce (see [Note: non-finite gradients]).
3. Gather. The updated shards' all-gathers are launched bucket by bucket and left in flight: the next forward
   completes each bucket just before the first module that uses it, and anything else that reads parameters waits
   first (see [Note: the parameter all-gather overlaps the next forward]) [nothing: each unit is gathered when it
   next runs]. ``end_step`` [frees the root unit].

At world size 1 (short cut on, no offload) the walk is the same with nothing in it but the update: no hook runs, no
bucket is packed, the masters are copied into the 16-bit parameters (mixed precision) or are their views (fp32).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.in_flight import BufferPool, gather_bucket
from lightning_zero.sharding.buckets import make_buckets
from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.grad_hooks import GradReducer
from lightning_zero.sharding.optimizer import ShardedOptimizer
from lightning_zero.sharding.param_hooks import ShardedParams
from lightning_zero.sharding.replicated import ReplicatedParams
from lightning_zero.sharding.roles import GradientRole, Offload, ParameterRole
from lightning_zero.sharding.scaling import NonFiniteGradientsError, StepScaling, scale_
from lightning_zero.sharding.shards import (Materialized, floating_buffers, load_state_dict_hooks, make_shards,
                                            sync_module_states)
from lightning_zero.sharding.single_rank import SingleRank
from lightning_zero.sharding.unit_state import Unit
from lightning_zero.sharding.units import plan_units
from lightning_zero.sharding.outside_step import EvaluationLoops, StateLoading
from lightning_zero.sharding.user_copies import UserCopies
from lightning_zero.sharding.user_view import UserView

__all__ = ["NonFiniteGradientsError", "ZeroRuntime", "sync_module_states"]


class ZeroRuntime(EvaluationLoops, StateLoading):
    """Shards ``module``'s parameters, reduces its gradients, gathers them (stage 3 on use), steps its optimizers.

    ``working_dtype`` (mixed precision) makes floating-point fp32 parameters 16-bit and their optimizer shards fp32
    masters (BatchNorm's stay fp32: ``F.batch_norm`` needs its weight in the running statistics' dtype).
    ``offload`` makes the offload of the shards (``lightning_zero.offload.make_offload``), if the config offloads.
    ``timeout``: the process group's (``ZeroStrategy(timeout=...)``), which zero3's unit-order board waits at most.
    """

    def __init__(
        self,
        module: nn.Module,
        config: ZeroConfig,
        comms: Collectives,
        working_dtype: torch.dtype | None = None,
        materialized: Materialized | None = None,
        offload: Callable[[list[ParamShard]], Offload] | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        self.module = module
        self.timeout = timeout
        self.config = config
        self.comms = comms
        self.working_dtype = working_dtype
        #: Hold what the formulas say between steps (``lean_memory``, which the strategy resolves from the budget:
        #: [Note: lean or fast memory]); a runtime made without the strategy is lean unless told otherwise.
        self.lean = config.lean_memory is not False
        #: The world-size-1 short cut: no hooks, no copies (see [Note: the world-size-1 path]); offload keeps its own.
        self.single_rank = (comms.local and comms.world_size == 1 and comms.replicas is None
                            and not config.offload.offload_optimizer)
        self.shards, self.cast = make_shards(module, config.stage, comms, working_dtype, materialized or {},
                                             self.single_rank)
        self.shard_of = {s.param: s for s in self.shards}
        #: What user code sees of the parameters and gradients (see [Note: what user code sees of a parameter and its
        #: gradient]).
        self.user_view = UserView(comms, self.shards)
        self.user_copies = UserCopies(comms, self.shards)  # see [Note: a user's copy of a sharded module]
        self.offload: Offload | None = None
        try:
            self._compose(offload)
        except BaseException:
            _empty_sharded(self.shards)  # the error is the one to see, not a sharded parameter Lightning then moves
            raise
        self.scaling = StepScaling(comms, config.nonfinite_grads)
        self.optimizers: dict[int, ShardedOptimizer] = {}
        #: Optimizers whose gradients ``unscale_for_hooks`` unscaled for this step.
        self._unscaled: dict[int, bool] = {}
        #: DDP's ``require_forward_param_sync``: the next forward broadcasts the buffers first (see ``_sync_buffers``).
        self._buffers_stale = True
        self._accumulating = False
        #: Whether ``release`` gave the module its full parameters back (end of fit).
        self.released = False

    def _compose(self, offload: Callable[[list[ParamShard]], Offload] | None) -> None:
        """The offload, the module hooks and the two roles of this stage (see the module docstring)."""
        module, config, comms = self.module, self.config, self.comms
        #: Where the masters and optimizer states live when offloaded (``lightning_zero.offload``), made from the shards.
        self.offload = offload(self.shards) if offload is not None else None
        self._module_hooks = load_state_dict_hooks(module, self.shards, self.wait, self._write_master,
                                                   self._after_state_dict_load)
        self._evaluation_hold = ExitStack()
        self.parameters: ParameterRole
        self.gradients: GradientRole
        if self.single_rank:
            if config.stage == 3:  # nothing is gathered by unit, but a units= entry that names no module is an error
                plan_units(module, config.stage3.units, config.stage3.unit_bytes)
            self.parameters = self.gradients = SingleRank(self.shards, config.comm.find_unused_parameters)
        elif config.stage == 3:
            sharded = self._sharded_params()
            if self.offload is not None:
                for unit in sharded.all_units:
                    unit.staged = self.offload.staged
            self.parameters = self.gradients = sharded
        else:
            pool = BufferPool(comms.device)  # bucket buffers shared by the gradient and parameter pipelines
            self.parameters = ReplicatedParams(module, self.shards, comms, config.comm, pool, lean=self.lean)
            self.gradients = GradReducer(self.shards, comms, config.comm, config.stage == 1, pool,
                                         self._grad_storage(), self.user_view.hand_out)

    @property
    def last_grad_norm(self) -> Tensor | None:
        """The global gradient norm (a device tensor) before the last clip by norm."""
        return self.scaling.last_grad_norm

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because a rank's gradients held an inf or NaN (``nonfinite_grads="skip"``)."""
        return self.scaling.skipped_steps

    def _sharded_params(self) -> ShardedParams:
        root_plan, plans = plan_units(self.module, self.config.stage3.units, self.config.stage3.unit_bytes)

        def unit(index: int, plan) -> Unit:
            shards = [self.shard_of[p] for p in plan.params if p in self.shard_of]
            return Unit(index, plan.name, plan.module, shards, self.comms)

        units = [unit(i + 1, p) for i, p in enumerate(plans)]
        return ShardedParams(unit(0, root_plan), units, self.comms, self.config.comm, self.config.stage3,
                             self._grad_storage(), self.user_view.hand_out, lean=self.lean, timeout=self.timeout)

    def _grad_storage(self):
        """Where gradient shards live: in memory, or where the offload keeps them (disk offload on a host)."""
        return self.offload.grad_storage() if self.offload is not None else None

    # ---------------------------------------------------------------------------------------------- optimizers

    def shard_optimizer(self, optimizer: Optimizer) -> ShardedOptimizer:
        keep_rows = self.offload.keep_state_rows if self.offload is not None else Tensor.clone
        sharded = ShardedOptimizer(optimizer, self.shard_of, keep_rows, self.comms, self.config.optimizer_sharding)
        if sharded.ownership is not None and self.offload is not None:
            raise ValueError(
                f"{type(optimizer).__name__} owns whole parameters (optimizer_sharding={self.config.optimizer_sharding!r}"
                f": its update is not known to be element-wise), and offloading an owned optimizer's states is not "
                "implemented: drop offload_optimizer, or use an element-wise optimizer (Adam, AdamW, SGD, ...)"
            )
        if self.offload is not None:
            self.offload.use_fused_kernels(optimizer)
        self.optimizers[id(optimizer)] = sharded
        return sharded

    def sharded(self, optimizer: Optimizer) -> ShardedOptimizer:
        try:
            return self.optimizers[id(optimizer)]
        except KeyError:
            raise RuntimeError(
                f"{type(optimizer).__name__} was not returned by configure_optimizers, so ZeRO has not sharded it"
            ) from None

    # --------------------------------------------------------------------------------------------------- a step

    def begin_step(self, training: bool, fitting: bool = True) -> None:
        """Before a training/evaluation step: buffers from rank 0 where DDP would broadcast them (see
        ``_sync_buffers``), the root unit's parameters (stage 3). ``fitting``: the step runs inside ``fit``."""
        if not training:
            self.wait()
        self._sync_buffers(training, fitting)
        self.adopt_rebindings()
        self.push_written_masters()
        self.parameters.begin_step()

    def _sync_buffers(self, training: bool, fitting: bool) -> None:
        """DDP's rule for ``broadcast_buffers`` (``DistributedDataParallel._pre_forward``/``_post_forward``): rank 0's
        buffers are broadcast before a forward of the wrapped module if the forward before it was a training forward
        that synchronizes gradients, and the module is wrapped only during ``fit``. So the validation inside ``fit``
        right after a training step runs on rank 0's BatchNorm statistics, the training step after a validation, or
        after a micro-batch under ``no_sync``, does not broadcast, and evaluation outside ``fit`` never does."""
        if not fitting:
            return
        buffers = floating_buffers(self.module) if self._buffers_stale and self.config.comm.broadcast_buffers else []
        if buffers:  # a module without any does without the call, as DDP does
            self.comms.world.broadcast_(buffers, "the module's floating-point buffers")
        self._buffers_stale = training and not self._accumulating

    def adopt_rebindings(self) -> None:
        """Parameters whose ``.data`` user code replaced since the last step are taken back before anything runs
        with them; gathers still in flight are waited for only if one was (user code that rebinds ran after the
        gate completed them)."""
        rebound = self.user_view.rebound()
        if rebound:
            self.wait()
            for shard in rebound:
                shard.adopt_edits(compare=False)

    def push_written_masters(self) -> None:
        """Stage-3 masters user code wrote through a parameter's values (``p.data.copy_(...)`` between steps: see
        [Note: a parameter's values between its uses]) go where the gathers read them: an offload pushes them to
        its working rows (otherwise the gathers read the masters themselves)."""
        if self.user_view.take_written() and self.offload is not None:
            self.offload.refresh()

    def reading_guard(self):
        """Around ``training_step``: a parameter whose all-gather is still in flight is completed before any
        operation reads it (see [Note: the parameter all-gather overlaps the next forward])."""
        return self.parameters.reading_guard()

    def wait(self) -> None:
        """Complete the parameter all-gathers still in flight: every parameter holds its current values."""
        self.parameters.wait()

    def pre_backward(self) -> None:
        # Gathers a forward left in flight (a module it skipped) are completed first: every rank then issues its
        # backward's reductions after the same gathers, whatever its forward ran.
        self.parameters.wait()
        self.user_view.begin_backward()
        self.gradients.pre_backward()

    def post_backward(self) -> None:
        self.gradients.post_backward()
        self.user_view.complete()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation between optimizer steps (stage 1 defers reduction to the boundary)."""
        self._accumulating = True
        try:
            with self.gradients.no_sync():
                yield
        finally:
            self._accumulating = False

    def end_step(self) -> None:
        """After the step's last backward, or after an evaluation step: free what stage 3 still holds gathered."""
        self.parameters.end_step()

    def step(self, optimizer: Optimizer, closure: Callable[[], Any], precision: Any, automatic: bool,
             defer_gather: bool = False, **kwargs: Any):
        """Run ``closure`` (forward and backward), then update ``optimizer``'s shards and gather them; see
        [Note: one optimizer step]. ``precision`` supplies the loss scaler and the recorded clip request;
        ``defer_gather``: no user code reads parameters before the next forward (or it waits): leave the gathers
        in flight."""
        result = closure()
        sharded = self.sharded(optimizer)
        clip = precision.take_clip()
        if result is None and automatic:
            self.end_step()
            return None  # training_step returned None: no backward, no step (as Lightning's AMP plugin)
        self.adopt_edits(compare=self.offload is None)
        clip_value = clip[1] if clip is not None and clip[0] == "value" else None
        unscaled = self._unscaled.pop(id(optimizer), False)
        if self.offload is not None:
            stepped = sharded.shards_with_grads()
            factor = self.scaling.agree([s.grad_rows() for s in stepped], precision.scaler, clip, unscaled)
            if factor is None:
                return None
            output = self.offload.update(sharded, stepped, float(factor), clip_value, **kwargs)  # the host steps
            if float(factor) != 1.0 or clip_value is not None:  # the host scaled its copies, or these
                self.user_view.changed()
        else:
            grads = sharded.step_grads()
            stepped = [s for s, _ in grads]
            factor = self.scaling.agree([g for _, g in grads], precision.scaler, clip, unscaled)
            if factor is None:
                return None
            scale_([g for _, g in grads], factor, clip_value)
            self.user_view.scaled(factor, clamped=clip_value is not None)
            output = sharded.update(grads, **kwargs)
        self.parameters.after_update(stepped, defer=defer_gather)
        return output

    @torch.no_grad()
    def unscale_for_hooks(self, optimizer: Optimizer, scaler: Any) -> None:
        """Under fp16 loss scaling, before ``on_before_optimizer_step``: ``optimizer``'s gradients become fp32 and
        unscaled, as Lightning's AMP plugin hands them to user code under DDP (see [Note: what user code sees of a
        parameter and its gradient]); the step then takes them as they are."""
        if scaler is None or not scaler.is_enabled():
            return
        self.user_view.unscale(self.sharded(optimizer).step_grads(), scaler)
        self._unscaled[id(optimizer)] = True

    def adopt_edits(self, compare: bool = True) -> None:
        """What user code wrote into the parameters is taken back into the shards (``UserView.take_back``), once
        every parameter holds its gathered values."""
        self.wait()
        self.user_view.take_back(compare)

    def grad_norm(self, norm_type: float = 2.0, group_separator: str = "/") -> dict[str, float]:
        """What Lightning's ``grad_norm(module, norm_type)`` returns under DDP, over every rank's gradient shards."""
        return self.user_view.grad_norms(norm_type, group_separator)

    # ------------------------------------------------------------------------------------------- outside a step

    @contextmanager
    def gathered_gradients(self) -> Iterator[None]:
        """Plain full gradients in ``param.grad`` for user code while inside; edits are kept (see
        ``UserView.gathered_gradients``)."""
        with self.user_view.gathered_gradients():
            yield

    @contextmanager
    def gathered(self) -> Iterator[None]:
        if self.released:  # after fit the module holds its full parameters already: nothing to gather or free
            yield
            return
        if isinstance(self.parameters, ShardedParams):
            self.user_view.join("trainer.strategy.gathered_parameters()", gradients=False)
        self.push_written_masters()
        with self.parameters.gathered(), self.user_copies.whole():
            yield

    def held_tensors(self) -> dict[str, Any]:
        """What the module's parameters and the optimizers' state do not show, for ``memory.model_state_bytes``:
        standalone local shards (stage 3) and hpZ's secondary shards, fp32 masters (optimizer state, as the ZeRO paper counts them; every
        master once offloaded), gradient shard storage, and which of them live on the host."""
        offloaded = self.offload is not None
        masters = [s.local for s in self.shards if offloaded or s.local.dtype != s.dtype]
        optimizers = [o.optimizer for o in self.optimizers.values()]
        disk = self.offload.disk_tensors(optimizers) if offloaded else []
        locals_ = [s.gather_source for s in self.shards if not offloaded and s.local.dtype == s.dtype]
        if isinstance(self.parameters, ShardedParams):
            locals_ += self.parameters.secondary_shards()  # hpZ, from a unit's forward to its backward
        working = [s.working for s in self.shards if offloaded and s.working is not None]
        host = list(masters) if offloaded else []
        if offloaded:
            host += [v for o in self.optimizers.values() for st in o.optimizer.state.values() for v in st.values()
                     if torch.is_tensor(v)]
            host += [s.working for s in self.shards if s.working is not None and s.working.device.type == "cpu" and
                     self.config.offload.offload_params]
        on_disk = {t.untyped_storage().data_ptr() for t in disk}
        host = [t for t in host if t.untyped_storage().data_ptr() not in on_disk]
        return {"extra_params": locals_ + working, "extra_grads": self.gradients.grad_buffers(),
                "extra_optimizer": masters, "host": host, "disk": disk, "buffers": self.parameters.kept_buffers(),
                "host_buffers": self.offload.host_buffers() if self.offload is not None else []}

    def refresh_full_parameters(self) -> None:
        """After the shards were loaded: offloaded masters are copied where the gathers read them; stages 1 and 2
        rebuild the full parameters (stage 3 gathers on use, and again the units gathered now)."""
        if self.offload is not None:
            self.offload.refresh()
        self.wait()
        self.parameters.after_update(self.shards)

    def check_offloaded_files(self) -> None:
        """Before a checkpoint reads the offloaded states through their files' mappings: none was truncated (disk
        offload: touching a mapped page past a file's end would kill the process; nothing to do otherwise)."""
        if self.offload is not None:
            self.offload.check_files()

    def release_offloaded_pages(self) -> None:
        """After a checkpoint read or wrote the offloaded states through their files' mappings: nothing of them
        stays resident (disk offload; nothing to do otherwise)."""
        if self.offload is not None:
            self.offload.release_pages()

    @torch.no_grad()
    def release(self, device: torch.device, gather: bool = True) -> None:
        """End of fit: remove the hooks and give the module its full parameters on ``device``, in the optimizer's
        precision (the fp32 masters under mixed precision), gathered bucket by bucket; the optimizers keep their
        shard-sized state (with parameter shards on disk, the full parameters are memory-mapped files: see
        ``DiskOffload.full_parameter``). A later setup shards the module again from these values. ``gather=False``
        (after an error) only removes the hooks: no collective, stage 3's parameters stay empty."""
        self.released = True
        self.user_view.stop_reads()
        if gather:
            self.check_offloaded_files()
            self.adopt_edits()
            self.end_evaluation()
        else:
            self._evaluation_hold.pop_all()
        self.gradients.remove()
        self.parameters.remove()
        for hook in self._module_hooks:
            hook.remove()
        optimizers = tuple(o.optimizer for o in self.optimizers.values())
        if not gather:
            _empty_sharded(self.shards)  # Lightning's teardown may still move the module
            if self.offload is not None:
                self.offload.close(optimizers)
            return
        replaced = [s for s in self.shards if s.local.dtype != s.dtype or s.sharded]
        keep = self.offload.full_parameter if self.offload is not None else Tensor.to
        transient = BufferPool(self.comms.device, limit=0)  # one bucket buffer at a time, not kept
        for dtype in dict.fromkeys(s.local.dtype for s in replaced):  # model order: the same on every rank
            for bucket in make_buckets([s for s in replaced if s.local.dtype == dtype], self.config.comm.bucket_bytes, dtype):
                params = [s.param for s in bucket.shards]
                for shard in bucket.shards:
                    shard.hold(torch.empty(shard.spec.shape, dtype=dtype, device=shard.device))
                gather_bucket(self.comms, transient, bucket, [s.local for s in bucket.shards]).complete(
                    partial(bucket.unpack, tensors=params))
                for param in params:
                    param.data = keep(param.data, device)
        for shard in self.shards:
            shard.released = True
            shard.mark_written()
        self.user_copies.release(device)
        if self.offload is not None:
            self.offload.close(optimizers)


def _empty_sharded(shards: list[ParamShard]) -> None:
    """After an error: every sharded parameter empty, of its own class (no gather: a peer may never answer)."""
    for shard in shards:
        if shard.sharded:
            shard.hold(torch.empty(0, dtype=shard.dtype, device=shard.device))
