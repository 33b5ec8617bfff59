"""ZeroRuntime: the sharding of one module, composed per stage, and the one owner of the optimizer step.

Stage 1 is the sharded optimizer, a ``GradReducer`` that keeps full gradients and reduces them at the accumulation
boundary, and ``ReplicatedParams`` (all-gather after the update). Stage 2 swaps in the reducer that keeps only
gradient shards. Stage 3 replaces both with ``ShardedParams`` (param_hooks.py), which gathers each unit around its
forward and backward and reduces per unit. The runtime only talks to these two roles: ``self.gradients`` (before and
after each backward) and ``self.parameters`` (around each step, after each update).

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
   clip coefficient into one factor on the device, and runs the user's optimizer on the local shards. A rank's inf
   or NaN is seen by every rank through that all-reduce (see [Note: non-finite gradients]).
3. Gather. The updated shards are all-gathered into the full parameters, bucket by bucket [nothing: each unit is
   gathered when it next runs]. ``end_step`` [frees the root unit].
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.flat_param import ParamShard, ShardSpec, clean_name, make_buckets, shard_parameters
from lightning_zero.sharding.grad_hooks import GradReducer
from lightning_zero.sharding.optimizer import ShardedOptimizer
from lightning_zero.sharding.param_hooks import ShardedParams, Unit
from lightning_zero.sharding.replicated import ReplicatedParams
from lightning_zero.sharding.units import plan_units

class NonFiniteGradientsError(FloatingPointError):
    """A rank's gradients held an inf or NaN and ``nonfinite_grads="raise"``; the message names the ranks."""


#: Local rows already cut from parameters built on the meta device: full shape and rows (see materialize.py).
Materialized = dict[nn.Parameter, tuple[torch.Size, Tensor]]


class ZeroRuntime:
    """Shards ``module``'s parameters, reduces its gradients, gathers them (stage 3 on use), steps its optimizers.

    ``working_dtype`` (mixed precision) makes floating-point fp32 parameters 16-bit and their optimizer shards fp32
    masters (BatchNorm's stay fp32: ``F.batch_norm`` needs its weight in the running statistics' dtype).
    ``host_ranks``: ranks on this machine (sharing its host memory and disk), for disk offload's space check.
    """

    def __init__(
        self,
        module: nn.Module,
        config: ZeroConfig,
        comms: Collectives,
        working_dtype: torch.dtype | None = None,
        materialized: Materialized | None = None,
        host_ranks: int = 1,
    ) -> None:
        self.module = module
        self.config = config
        self.comms = comms
        self.working_dtype = working_dtype
        _refuse_complex(module)
        self.cast = _working_parameters(module) if working_dtype is not None else set()
        if config.stage == 3:
            self.shards = _stage3_shards(module, comms, self.cast, materialized or {})
        else:
            self.shards = _replicated_shards(module, comms, self.cast)
        with torch.no_grad():
            for shard in self.shards:
                if shard.param in self.cast:
                    shard.dtype = working_dtype
                    if not shard.sharded:
                        shard.param.data = shard.param.data.to(working_dtype)
                shard.mark_written()
        self.shard_of = {s.param: s for s in self.shards}
        self.offload = _make_offload(self.shards, config, comms, host_ranks) if config.offload.offload_optimizer else None
        self._module_hooks = _load_state_dict_hooks(module, self.shards)
        self._evaluation_hold = ExitStack()
        if config.stage == 3:
            self.parameters = self.gradients = self._sharded_params()
            if self.offload is not None:
                for unit in self.parameters.all_units:
                    unit.staged = self.offload.staged
        else:
            self.parameters = ReplicatedParams(comms, config.comm)
            self.gradients = GradReducer(self.shards, comms, config.comm, keep_full_grads=config.stage == 1)
        self.optimizers: dict[int, ShardedOptimizer] = {}
        self.last_grad_norm: Tensor | None = None
        #: Whether ``release`` gave the module its full parameters back (end of fit).
        self.released = False
        #: Optimizer steps skipped because a rank's gradients held an inf or NaN (``nonfinite_grads="skip"``).
        self.skipped_steps = 0

    def _sharded_params(self) -> ShardedParams:
        root_plan, plans = plan_units(self.module, self.config.stage3.units, self.config.stage3.unit_bytes)

        def unit(index: int, plan) -> Unit:
            shards = [self.shard_of[p] for p in plan.params if p in self.shard_of]
            return Unit(index, plan.name, plan.module, shards, self.comms)

        units = [unit(i + 1, p) for i, p in enumerate(plans)]
        return ShardedParams(unit(0, root_plan), units, self.comms, self.config.comm, self.config.stage3)

    # ---------------------------------------------------------------------------------------------- optimizers

    def shard_optimizer(self, optimizer: Optimizer) -> ShardedOptimizer:
        sharded = ShardedOptimizer(optimizer, self.shard_of)
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

    def begin_step(self, training: bool) -> None:
        """Before a training/evaluation step: buffers from rank 0 (as DDP), the root unit's parameters (stage 3)."""
        if training and self.config.comm.broadcast_buffers:
            self.comms.broadcast_(_floating_buffers(self.module), "the module's floating-point buffers")
        self.parameters.begin_step()

    def pre_backward(self) -> None:
        self.gradients.pre_backward()

    def post_backward(self) -> None:
        self.gradients.post_backward()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation between optimizer steps (stage 1 defers reduction to the boundary)."""
        with self.gradients.no_sync():
            yield

    def end_step(self) -> None:
        """After the step's last backward, or after an evaluation step: free what stage 3 still holds gathered."""
        self.parameters.end_step()

    def step(self, optimizer: Optimizer, closure: Callable[[], Any], precision: Any, automatic: bool, **kwargs: Any):
        """Run ``closure`` (forward and backward), then update ``optimizer``'s shards and gather them; see
        [Note: one optimizer step]. ``precision`` supplies the loss scaler and the recorded clip request."""
        result = closure()
        sharded = self.sharded(optimizer)
        clip = precision.take_clip()
        if result is None and automatic:
            self.end_step()
            return None  # training_step returned None: no backward, no step (as Lightning's AMP plugin)
        self.adopt_edits()
        clip_value = clip[1] if clip is not None and clip[0] == "value" else None
        if self.offload is not None:
            stepped = sharded.shards_with_grads()
            factor = self._agree_factor([s.param.grad for s in stepped], precision.scaler, clip)
            if factor is None:
                return None
            output = self.offload.update(sharded, stepped, float(factor), clip_value, **kwargs)
        else:
            grads = sharded.step_grads()
            stepped = [s for s, _ in grads]
            factor = self._agree_factor([g for _, g in grads], precision.scaler, clip)
            if factor is None:
                return None
            _scale_(grads, factor, clip_value)
            output = sharded.update(grads, **kwargs)
        self.parameters.after_update(stepped)
        return output

    @torch.no_grad()
    def _agree_factor(self, grads: list[Tensor], scaler: Any, clip: tuple[str, float] | None) -> Tensor | float | None:
        """The factor the gradients are multiplied by (the loss scale's inverse, the clip coefficient), or ``None``
        when the step is skipped on every rank; see [Note: non-finite gradients]."""
        inv_scale = 1.0 / scaler.get_scale() if scaler is not None else 1.0
        by_norm = clip is not None and clip[0] == "norm"
        policy = self.config.nonfinite_grads
        factor: Tensor | float = inv_scale
        if scaler is None and not by_norm and policy == "ignore":
            return factor
        norm, failed = self._global_norm(grads)
        norm = norm * inv_scale
        if scaler is not None:
            scaler.update_from((~torch.isfinite(norm)).float())
        if (scaler is not None or policy != "ignore") and not torch.isfinite(norm).item():
            if scaler is None:
                self._on_nonfinite(failed)
            return None
        if by_norm:
            self.last_grad_norm = norm
            factor = inv_scale * torch.clamp(clip[1] / (norm + 1e-6), max=1.0)
        return factor

    def _on_nonfinite(self, failed: Tensor) -> None:
        """[Note: non-finite gradients] An inf or NaN in any rank's gradients makes the global norm non-finite on
        every rank at once (one all-reduce carries the sum of squares and which ranks saw one), so every rank takes
        the same decision: fp16 loss scaling backs off and skips the step (as GradScaler); otherwise
        ``nonfinite_grads="skip"`` skips it and warns, ``"raise"`` raises, both naming the ranks, and ``"ignore"``
        (the default, with no check at all) steps as DDP would: the non-finite values spread through the averaged
        gradients alike on every rank, so the ranks never diverge from one another."""
        ranks = [r for r, bad in enumerate(failed.tolist()) if bad]
        where = f"rank(s) {ranks}" if ranks else "the global norm (its sum of squares overflowed)"
        message = f"non-finite gradients (inf or NaN) on {where} at this optimizer step"
        if self.config.nonfinite_grads == "raise":
            raise NonFiniteGradientsError(message + "; nonfinite_grads='skip' skips such steps instead")
        self.skipped_steps += 1
        rank_zero_warn(message + "; the step was skipped on every rank (nonfinite_grads='skip')")

    def _global_norm(self, grads: list[Tensor]) -> tuple[Tensor, Tensor]:
        """The L2 norm of every rank's gradient shards together (padding excluded), and which ranks' shards hold an
        inf or NaN: one all-reduce."""
        stats = torch.zeros(1 + self.comms.world_size, dtype=torch.float32, device=self.comms.device)
        for dtype in {g.dtype for g in grads}:
            group = [g for g in grads if g.dtype == dtype and g.numel() > 0]
            if group:
                norms = torch._foreach_norm(group, 2, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
                stats[0] += torch.stack(norms).float().square().sum().to(stats.device)
        stats[1 + self.comms.rank] = (~torch.isfinite(stats[0])).float()
        self.comms.all_reduce_(stats, "the gradient norm")
        return stats[0].sqrt(), stats[1:]

    def adopt_edits(self) -> None:
        """Parameters changed in place since the shards last wrote them keep their new values (see
        ``ParamShard.adopt_edits``; under mixed precision the fp32 masters take them)."""
        for shard in self.shards:
            shard.adopt_edits()

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0, group_separator: str = "/") -> dict[str, float]:
        """What Lightning's ``grad_norm(module, norm_type)`` returns under DDP, from the reduced gradient shards of
        every rank (one all-reduce): the norm of each parameter's whole gradient and their total."""
        norm_type = float(norm_type)
        named = [(s.name, s.param.grad) for s in self.shards if s.param.grad is not None]
        if norm_type == float("inf"):
            parts = torch.stack([g.abs().max().float() if g.numel() else g.new_zeros((), dtype=torch.float32)
                                 for _, g in named]) if named else torch.zeros(0)
            parts = parts.to(self.comms.device)
            self.comms.all_reduce_(parts, "the gradient norms", op="max")
            norms = parts
        else:
            parts = torch.stack([g.float().abs().pow(norm_type).sum() for _, g in named]) if named else torch.zeros(0)
            parts = parts.to(self.comms.device)
            self.comms.all_reduce_(parts, "the gradient norms")
            norms = parts.pow(1.0 / norm_type)
        values = norms.tolist()
        out = {f"grad_{norm_type}_norm{group_separator}{name}": v for (name, _), v in zip(named, values)}
        if values:
            total = max(values) if norm_type == float("inf") else float(norms.pow(norm_type).sum().pow(1 / norm_type))
            out[f"grad_{norm_type}_norm_total"] = total
        return out

    # ------------------------------------------------------------------------------------------- outside a step

    def begin_evaluation(self, batches: float, loop: str) -> None:
        """Before an evaluation loop: under stage 3, ranks that will run different numbers of batches (Lightning
        does not pad ``predict``; a custom sampler may not pad validate/test) cannot gather unit by unit, as every
        gather is a collective; they gather the whole model once for the loop instead, and say so."""
        if not isinstance(self.parameters, ShardedParams) or self.comms.local:
            return
        counts = torch.tensor([batches, -batches], dtype=torch.float64, device=self.comms.device)
        self.comms.all_reduce_(counts, f"the {loop} batch counts", op="max")
        most, fewest = counts[0].item(), -counts[1].item()
        if most == fewest and most != float("inf"):
            return
        full = sum(s.spec.numel * s.dtype.itemsize for s in self.shards)
        _check_fits(full, self.comms.device, loop)
        rank_zero_info(
            f"zero3 {loop}: ranks run different numbers of batches ({_count(fewest)} to {_count(most)}), so the whole "
            f"model ({full / 2**20:.1f} MiB per rank) is gathered once for this loop instead of unit by unit"
        )
        self._evaluation_hold.enter_context(self.parameters.gathered())

    def end_evaluation(self) -> None:
        self._evaluation_hold.close()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        with self.parameters.gathered():
            yield

    def held_tensors(self) -> dict[str, Any]:
        """What the module's parameters and the optimizers' state do not show, for ``memory.model_state_bytes``:
        standalone local shards (stage 3), fp32 masters (optimizer state, as the ZeRO paper counts them; every
        master once offloaded), gradient shard storage, and which of them live on the host."""
        offloaded = self.offload is not None
        masters = [s.local for s in self.shards if offloaded or s.local.dtype != s.dtype]
        optimizers = [o.optimizer for o in self.optimizers.values()]
        disk = self.offload.disk_tensors(optimizers) if hasattr(self.offload, "disk_tensors") else []
        locals_ = [s.gather_source for s in self.shards if not offloaded and s.local.dtype == s.dtype]
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
                "extra_optimizer": masters, "host": host, "disk": disk}

    def refresh_full_parameters(self) -> None:
        """After the shards were loaded: offloaded masters are copied where the gathers read them; stages 1 and 2
        rebuild the full parameters (stage 3 gathers on use)."""
        if self.offload is not None:
            self.offload.push(self.shards)
        if isinstance(self.parameters, ReplicatedParams):
            self.parameters.gather(self.shards)

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
            shard.local.copy_(shard.spec.local_view(value))
        for name, buffer in buffers.items():
            if name in state_dict and torch.is_tensor(buffer):
                buffer.copy_(state_dict[name])
        self.refresh_full_parameters()

    @torch.no_grad()
    def release(self, device: torch.device, gather: bool = True) -> None:
        """End of fit: remove the hooks and give the module its full parameters on ``device``, in the optimizer's
        precision (the fp32 masters under mixed precision), gathered bucket by bucket; the optimizers keep their
        shard-sized state. A later setup shards the module again from these values. ``gather=False`` (after an
        error) only removes the hooks: no collective, stage 3's parameters stay empty."""
        self.released = True
        if gather:
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
            if self.offload is not None:
                self.offload.close(optimizers)
            return
        replaced = [s for s in self.shards if s.local.dtype != s.dtype or s.sharded]
        for dtype in {s.local.dtype for s in replaced}:
            for bucket in make_buckets([s for s in replaced if s.local.dtype == dtype], self.config.comm.bucket_bytes, dtype):
                for shard in bucket.shards:
                    shard.param.data = torch.empty(shard.spec.shape, dtype=dtype, device=shard.device)
                    shard.sharded = False
                gathered = self.comms.all_gather(bucket, [s.local for s in bucket.shards]).wait()
                bucket.unpack(gathered, [s.param for s in bucket.shards])
                for shard in bucket.shards:
                    shard.param.data = shard.param.data.to(device)
        if self.offload is not None:
            self.offload.close(optimizers)


def _scale_(grads: list[tuple[ParamShard, Tensor]], factor: Tensor | float, clip_value: float | None) -> None:
    tensors = [g for _, g in grads]
    if tensors and (torch.is_tensor(factor) or factor != 1.0):
        torch._foreach_mul_(tensors, factor)
    if clip_value is not None and tensors:
        torch._foreach_clamp_min_(tensors, -clip_value)
        torch._foreach_clamp_max_(tensors, clip_value)


def _make_offload(shards: list[ParamShard], config: ZeroConfig, comms: Collectives, host_ranks: int):
    """The host or disk offload of ``config``; a disk that cannot hold the states fails on every rank at once."""
    from lightning_zero.offload.disk import DiskOffload, OffloadDiskError, private_directory
    from lightning_zero.offload.host import HostOffload

    offload = config.offload
    if not offload.on_disk:
        return HostOffload(shards, config.stage, config.comm.bucket_bytes, offload.offload_params == "cpu")
    params_on_disk = offload.offload_params == "disk"
    # fp32 masters and, as for Adam, two fp32 moments per element; the parameter shards too when they go to disk.
    needed = sum(s.spec.local_numel * (12 + (s.dtype.itemsize if params_on_disk else 0)) for s in shards)
    failure: OffloadDiskError | None = None
    result = None
    try:
        directory = private_directory(offload.offload_dir, comms.rank, needed, host_ranks)
        result = DiskOffload(shards, config.stage, offload.subgroup_bytes, directory,
                             offload.offload_resident_subgroups, params_on_disk)
    except OffloadDiskError as err:
        failure = err
    failed = torch.tensor([float(failure is not None)], device=comms.device)
    comms.all_reduce_(failed, "the disk offload set-up flags", op="max")
    if failed.item():
        if result is not None:
            result.close()
        raise failure or OffloadDiskError("disk offload could not be set up on another rank (its error says why)")
    return result


def _load_state_dict_hooks(module: nn.Module, shards: list[ParamShard]) -> list:
    """``module.load_state_dict`` after setup writes each rank's rows, at full precision, into its shards (the fp32
    masters under mixed precision); parameters stage 3 keeps empty are skipped by torch's own copy."""

    @torch.no_grad()
    def before(_module, state_dict, prefix, *_args) -> None:
        for shard in shards:
            key = prefix + shard.name
            value = state_dict.get(key)
            if not torch.is_tensor(value) or value.shape != shard.spec.shape:
                continue  # missing or mis-shaped: torch's own load reports it
            rows = shard.spec.local_view(value.to(shard.device))
            shard.local.copy_(rows)
            if shard.sharded:  # the parameter is its local shard: torch's own copy writes the same rows
                state_dict[key] = rows

    def after(_module, _incompatible) -> None:
        for shard in shards:
            shard.mark_written()

    register_pre = getattr(module, "register_load_state_dict_pre_hook", None)
    pre = register_pre(before) if register_pre else module._register_load_state_dict_pre_hook(before, with_module=True)
    return [pre, module.register_load_state_dict_post_hook(after)]


def _check_fits(nbytes: int, device: torch.device, loop: str) -> None:
    if device.type != "cuda":
        return
    free = torch.cuda.mem_get_info(device)[0]
    if nbytes > free:
        raise RuntimeError(
            f"zero3 {loop}: ranks run different numbers of batches, and the whole model ({nbytes / 2**30:.2f} GiB) "
            f"does not fit in the {free / 2**30:.2f} GiB free on {device} to be gathered once: give every rank the "
            "same number of batches (pad the dataset to a multiple of the world size)"
        )


def _count(n: float) -> str:
    return "unknown" if n == float("inf") else str(int(n))


def _refuse_complex(module: nn.Module) -> None:
    for name, param in module.named_parameters():
        if param.is_complex():
            raise ValueError(
                f"parameter {name!r} is complex ({param.dtype}); ZeroStrategy shards real-valued parameters only: "
                "keep it as torch.view_as_real (a real tensor with a last dimension of 2)"
            )


def _working_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The parameters mixed precision makes 16-bit: fp32 ones outside BatchNorm layers."""
    batch_norm = {p for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for p in m.parameters()}
    return {p for p in module.parameters() if p.dtype == torch.float32 and p not in batch_norm}


def _replicated_shards(module: nn.Module, comms: Collectives, cast: set[nn.Parameter]) -> list[ParamShard]:
    """Stages 1 and 2: local rows as views of the full parameters, or fp32 master copies of those cast to 16 bits."""
    shards = []
    for name, param in module.named_parameters():
        master = torch.float32 if param in cast else None
        shards += shard_parameters([(name, param)], comms.rank, comms.world_size, master)
    return shards


def _stage3_shards(
    module: nn.Module, comms: Collectives, cast: set[nn.Parameter], materialized: Materialized
) -> list[ParamShard]:
    """Stage 3: standalone local rows (fp32 masters of those cast to 16 bits), which the parameters then hold."""
    shards = []
    for name, param in module.named_parameters():
        if param in materialized:
            shape, rows = materialized[param]
        else:
            shape = param.shape
            rows = ShardSpec(shape, comms.rank, comms.world_size).local_view(param.detach()).clone()
        local = rows.float() if param in cast else rows
        spec = ShardSpec(shape, comms.rank, comms.world_size)
        shard = ParamShard(clean_name(name), param, spec, local, param.dtype, param.device)
        shard.to_sharded()
        shards.append(shard)
    return shards


def sync_module_states(module: nn.Module, comms: Collectives) -> None:
    """Give every rank rank 0's parameters and buffers, as DDP does when it wraps a module.

    Parameters already sharded by large-model init are empty and skipped: every rank drew the same values.
    """
    tensors = [p.detach() for p in module.parameters()] + list(module.buffers())
    comms.broadcast_([t for t in tensors if t.numel() > 0], "the module's parameters and buffers (sync_module_states)")


def _floating_buffers(module: nn.Module) -> list[Tensor]:
    return [b for b in module.buffers() if b.is_floating_point() and b.numel() > 0]
