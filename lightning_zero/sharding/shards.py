"""Making the shards of a module at setup: which parameters become 16-bit, the ``ParamShard`` of every parameter
(per stage, and at world size 1), and the module-level hooks that keep them in step with ``load_state_dict``.

Bookkeeping of a single parameter lives in flat_param.py; this module decides, once per setup, what each parameter
of a whole module becomes. Only ``sync_module_states`` communicates (through ``Collectives``), as DDP does when it
wraps a module.

[Note: shards at world size 1]
With one rank and the short cut on (``shortcut_single_rank=True``, the default), a rank owns every row, nothing is
communicated, and stages differ only in what they would free: there is nothing to free. ``single_rank_shards``
therefore makes the shards of every stage the way stages 1 and 2 make theirs: ``local`` a view of the full
parameter (full precision) or an fp32 master copy of it (mixed precision), the parameter never sharded. The
checkpoint format is the same (every name, every row, the same metadata); only where the rows live differs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.flat_param import (
    ParamShard,
    ShardSpec,
    clean_name,
    shard_parameters,
)

#: Local rows already cut from parameters built on the meta device: full shape and rows (see materialize.py).
Materialized = dict[nn.Parameter, tuple[torch.Size, Tensor]]


def make_shards(
    module: nn.Module,
    stage: int,
    comms: Collectives,
    working_dtype: torch.dtype | None,
    materialized: Materialized,
    single_rank: bool,
) -> tuple[list[ParamShard], set[nn.Parameter]]:
    """The shards of ``module``'s parameters, and the parameters made ``working_dtype`` (mixed precision).

    ``single_rank``: the world-size-1 short cut (see [Note: shards at world size 1]).
    """
    refuse_complex(module)
    cast = working_parameters(module) if working_dtype is not None else set()
    if single_rank:
        shards = single_rank_shards(module, cast, materialized)
    elif stage == 3:
        shards = stage3_shards(module, comms, cast, materialized)
    else:
        shards = replicated_shards(module, comms.rank, comms.world_size, cast)
    with torch.no_grad():
        for shard in shards:
            if shard.param in cast:
                shard.dtype = working_dtype
                if not shard.sharded:
                    shard.param.data = shard.param.data.to(working_dtype)
            shard.mark_written()
    return shards, cast


def refuse_complex(module: nn.Module) -> None:
    for name, param in module.named_parameters():
        if param.is_complex():
            raise ValueError(
                f"parameter {name!r} is complex ({param.dtype}); ZeroStrategy shards real-valued parameters only: "
                "keep it as torch.view_as_real (a real tensor with a last dimension of 2)"
            )


def working_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The parameters mixed precision makes 16-bit: fp32 ones outside BatchNorm layers."""
    batch_norm = {p for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for p in m.parameters()}
    return {p for p in module.parameters() if p.dtype == torch.float32 and p not in batch_norm}


def replicated_shards(module: nn.Module, rank: int, world_size: int, cast: set[nn.Parameter]) -> list[ParamShard]:
    """Stages 1 and 2: local rows as views of the full parameters, or fp32 master copies of those cast to 16 bits."""
    shards = []
    for name, param in module.named_parameters():
        master = torch.float32 if param in cast else None
        shards += shard_parameters([(name, param)], rank, world_size, master)
    return shards


def single_rank_shards(module: nn.Module, cast: set[nn.Parameter], materialized: Materialized) -> list[ParamShard]:
    """World size 1 with the short cut, any stage: every row is local and the parameters stay whole. A stage-3
    parameter materialized from the meta device gets its rows (all of them) back as its data first."""
    with torch.no_grad():
        for param, (shape, rows) in materialized.items():
            param.data = rows.view(shape)
    return replicated_shards(module, 0, 1, cast)


def stage3_shards(
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


def floating_buffers(module: nn.Module) -> list[Tensor]:
    return [b for b in module.buffers() if b.is_floating_point() and b.numel() > 0]


def load_state_dict_hooks(
    module: nn.Module, shards: list[ParamShard], before_load: Callable[[], None],
    write_master: Callable[[ParamShard, Tensor], None], after_load: Callable[[], None],
) -> list:
    """``module.load_state_dict`` after setup writes each rank's rows, at full precision, into its shards (the fp32
    masters under mixed precision; ``write_master``, which an offload routes where its masters live). A sharded
    stage-3 parameter holds no values (see [Note: a sharded parameter keeps its shape]): its entry is taken out of
    torch's own copy and out of the keys torch then reports missing. ``before_load`` runs first: it completes the
    parameter all-gathers still in flight, which read the shards (a parameter gathered in place sends its own rows)
    and would otherwise write stale rows after the load; ``after_load`` runs last (an offload pushes the new
    masters where the gathers read them)."""
    taken: list[str] = []

    @torch.no_grad()
    def before(_module, state_dict, prefix, *_args) -> None:
        before_load()
        taken.clear()
        for shard in shards:
            key = prefix + shard.name
            value = state_dict.get(key)
            if not torch.is_tensor(value) or value.shape != shard.spec.shape:
                continue  # missing or mis-shaped: torch's own load reports it
            write_master(shard, shard.spec.local_view(value.to(shard.device)))
            if shard.sharded:
                del state_dict[key]
                taken.append(key)

    def after(_module, incompatible) -> None:
        for key in taken:
            if key in incompatible.missing_keys:
                incompatible.missing_keys.remove(key)
        for shard in shards:
            shard.mark_written()
        after_load()

    register_pre = getattr(module, "register_load_state_dict_pre_hook", None)
    pre = register_pre(before) if register_pre else module._register_load_state_dict_pre_hook(before, with_module=True)
    return [pre, module.register_load_state_dict_post_hook(after)]
