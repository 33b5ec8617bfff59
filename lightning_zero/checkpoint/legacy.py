"""Checkpoint directories, the format lightning_zero wrote before checkpoints became one file: still loaded (each
rank reading only the rows it owns) and consolidated, no longer written. See [Note: checkpoint directories] in
layout.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_zero.checkpoint.layout import (
    FORMAT_KEY,
    MANIFEST_FILE,
    CheckpointError,
    check_compatible,
    check_files,
    check_optimizer_class,
    file_damage,
    read_dcp_metadata,
    read_manifest,
    read_meta,
    shard_dtensor,
    stored_shapes,
    to_shape,
)
from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.optimizer import ShardedOptimizer


def _model_destinations(module: nn.Module, shards: list[ParamShard], mesh: DeviceMesh) -> dict[str, Tensor]:
    """Fresh tensors shaped like ``model_tensors`` (every rank reads the buffers) for a load to fill."""
    tensors: dict[str, Tensor] = {s.name: shard_dtensor(torch.zeros_like(s.local), s.spec, mesh) for s in shards}
    tensors.update({k: torch.zeros_like(v) for k, v in persistent_buffers(module).items()})
    return tensors


def persistent_buffers(module: nn.Module) -> dict[str, Tensor]:
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if k not in params and torch.is_tensor(v)}


def optimizer_destinations(
    sharded: ShardedOptimizer, stored: dict[str, TensorStorageMetadata], prefix: str, mesh: DeviceMesh
) -> dict[str, dict[str, Tensor]]:
    """Empty tensors, shaped for this rank, for every optimizer state entry the checkpoint holds under ``prefix``."""
    destinations: dict[str, dict[str, Tensor]] = {}
    for shard in sharded.shards:
        head = f"{prefix}{shard.name}."
        for key, meta in stored.items():
            if not key.startswith(head) or "." in key[len(head) :]:
                continue
            entry = destinations.setdefault(shard.name, {})
            size = torch.Size(meta.size)
            if size == to_shape(shard.spec.shape) and len(size) > 0:
                local = torch.zeros(shard.spec.local_shape, dtype=meta.properties.dtype, device=shard.local.device)
                entry[key[len(head) :]] = shard_dtensor(local, shard.spec, mesh)
            else:
                entry[key[len(head) :]] = torch.zeros(size, dtype=meta.properties.dtype)
    return destinations


def _check_optimizer(sharded: ShardedOptimizer, groups: list[dict], saved_class: str | None, index: int) -> None:
    """The checkpoint's optimizer is of the live one's class and steps the same parameters (by name)."""
    check_optimizer_class(saved_class, sharded.optimizer, index)
    names = sorted(n for g in groups for n in g["params"])
    live = sorted(s.name for s in sharded.shards)
    if names != live:
        raise CheckpointError(
            f"the checkpoint's {type(sharded.optimizer).__name__} steps {sorted(set(names) ^ set(live))} "
            "differently from this one"
        )


def _load_optimizer(sharded: ShardedOptimizer, loaded: dict[str, dict[str, Tensor]], groups: list[dict]) -> None:
    """Hand state loaded by name to the live optimizer (which keys its state by position)."""
    shards = sharded.shards
    position = {shard.name: i for i, shard in enumerate(shards)}
    state = {}
    for name, entry in loaded.items():
        state[position[name]] = {
            key: (value.to_local().view(shards[position[name]].spec.local_shape) if isinstance(value, DTensor)
                  else value)
            for key, value in entry.items()
        }
    sharded.load_state_dict(
        {"state": state, "param_groups": [dict(g, params=[position[n] for n in g["params"]]) for g in groups]}
    )


def _verify_reads(path: Path, tensors: dict[str, Any], comms) -> None:
    """Check the files this rank is about to read against the manifest, and agree across ranks: a damaged file
    fails the load on every rank, naming it, before DCP reads anything."""
    manifest = read_manifest(path)
    if manifest is None:
        return  # saved before checksums were recorded: every rank skips alike
    planner = DefaultLoadPlanner()
    metadata = read_dcp_metadata(path)
    planner.set_up_planner(tensors, metadata, is_coordinator=False)
    plan = planner.create_local_plan()
    reads = sorted({metadata.storage_data[item.storage_index].relative_path for item in plan.items})
    names = sorted(manifest)
    found = next((name for name in reads if file_damage(path, manifest, name) is not None), None)
    code = -1 if found is None else names.index(found) if found in manifest else len(names)
    verdicts = comms.exchange([code])
    failed = [r for r, (code,) in enumerate(verdicts) if code >= 0]
    if failed:
        code = verdicts[failed[0]][0]
        problem = (file_damage(path, manifest, names[code]) if code < len(names) else None) or (
            f"rank {failed[0]} reads a file that {MANIFEST_FILE} does not list as it was saved"
        )
        raise CheckpointError(f"reading {path} failed on rank(s) {failed} ({problem}); nothing was changed")


def load_directory(
    path: str | os.PathLike,
    module: nn.Module,
    shards: list[ParamShard],
    optimizers: list[ShardedOptimizer],
    mesh: DeviceMesh,
    comms,
) -> dict[str, Any]:
    """Read a checkpoint directory into ``shards``, the module's buffers and ``optimizers`` (none: weights only).

    Atomic (see [Note: checkpoint layout]): every file and every name and shape is checked, everything is read into
    fresh tensors, and only then are the live ones overwritten; a read that fails on any rank fails on every rank
    (DCP gathers the errors), with nothing changed. Returns Lightning's part of the checkpoint, for Lightning to
    restore its own state from.
    """
    path, meta = read_meta(path)
    info = meta.pop(FORMAT_KEY)
    stored = check_files(path, verify=False)  # each rank checks the checksums of what it reads, below
    model = _model_destinations(module, shards, mesh)
    check_compatible({k: v.shape for k, v in model.items()}, stored_shapes(stored, "model."))
    tensors: dict[str, Any] = {"model": model}
    groups = info["optimizer_param_groups"]
    if groups is not None and optimizers:
        if len(groups) != len(optimizers):
            raise CheckpointError(
                f"the checkpoint has {len(groups)} optimizer(s), configure_optimizers returned {len(optimizers)}"
            )
        classes = info.get("optimizer_classes") or [None] * len(groups)
        for i, (optimizer, optimizer_groups) in enumerate(zip(optimizers, groups)):
            _check_optimizer(optimizer, optimizer_groups, classes[i], i)
        tensors["optim"] = {
            str(i): optimizer_destinations(o, stored, f"optim.{i}.", mesh) for i, o in enumerate(optimizers)
        }
    _verify_reads(path, tensors, comms)
    try:
        dcp.load(tensors, checkpoint_id=path, process_group=comms.group if comms.distributed else None,
                 no_dist=not comms.distributed)
    except CheckpointException as err:
        rank, failure = next(iter(sorted(err.failures.items())))
        raise CheckpointError(
            f"reading {path} failed on rank(s) {sorted(err.failures)} (rank {rank}: {type(failure).__name__}: "
            f"{str(failure).splitlines()[0] if str(failure) else ''}); nothing was changed"
        ) from err
    with torch.no_grad():
        for shard in shards:
            shard.local.copy_(model[shard.name].to_local().view(shard.local.shape))
        for name, buffer in persistent_buffers(module).items():
            buffer.copy_(model[name])
    if "optim" in tensors:
        for i, optimizer in enumerate(optimizers):
            _load_optimizer(optimizer, tensors["optim"][str(i)], groups[i])
    if groups is not None:
        meta["optimizer_states"] = []  # restored above; present so that Lightning does not report it missing
    meta["state_dict"] = {}
    return meta
