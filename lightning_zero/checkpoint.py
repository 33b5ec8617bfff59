"""Sharded checkpoints: torch.distributed.checkpoint directories keyed by parameter name, resharded on load.

[Note: checkpoint layout]
A checkpoint is a directory::

    .metadata, __*_*.distcp   torch.distributed.checkpoint (DCP): every rank writes only the rows it owns
    lightning.pt              rank 0: Lightning's own state (loops, callbacks, LR schedulers, loss scaler,
                              hyper-parameters) and ours (parameter shapes, tied-weight aliases, optimizer groups)

DCP holds ``model.<name>`` for every parameter (the fp32 master under mixed precision) and persistent buffer, at its
full shape, and ``optim.<i>.<name>.<key>`` for optimizer ``i``'s state, keyed by parameter name rather than position.
A shard is handed to DCP as a ``DTensor`` placed ``Shard(0)`` over the ranks, whose row split is exactly ours (chunks
of ``ceil(rows / N)``, see [Note: how a parameter is split]); a 0-d parameter is stored as shape ``(1,)``. So a load
at any world size and stage reads, on each rank, only the rows that rank now owns, and DCP does the resharding.

Saving is atomic: everything goes to ``<path>.partial``, which replaces ``<path>`` only once every rank has finished
(the previous checkpoint is moved to ``<path>.old`` for the instant of the swap). A rank dying mid-save leaves the
previous checkpoint at ``<path>`` untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_zero.sharding.flat_param import ParamShard, ShardSpec
from lightning_zero.sharding.optimizer import ShardedOptimizer, is_per_element

META_FILE = "lightning.pt"
FORMAT_KEY = "lightning_zero"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded into this model; the message names what is wrong."""


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return _resolve(Path(path)) is not None


def _resolve(path: Path) -> Path | None:
    """The directory holding the checkpoint: ``path``, or ``path.old`` if a save was interrupted mid-swap."""
    for candidate in (path, path.with_name(path.name + ".old")):
        if (candidate / META_FILE).is_file():
            return candidate
    return None


def to_shape(shape: Iterable[int]) -> torch.Size:
    """The shape a parameter is stored at (0-d parameters as one row)."""
    shape = torch.Size(shape)
    return shape if len(shape) > 0 else torch.Size([1])


# -------------------------------------------------------------------------------------------------- state to save


def shard_dtensor(local: Tensor, spec: ShardSpec, mesh: DeviceMesh) -> DTensor:
    """This rank's rows of a tensor of ``spec.shape``, as the ``Shard(0)`` DTensor DCP stores and reshards."""
    shape = to_shape(spec.shape)
    stride = torch.empty(shape, device="meta").stride()
    local = local.reshape(spec.local_rows, *shape[1:])
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def model_tensors(module: nn.Module, shards: list[ParamShard] | None, mesh: DeviceMesh | None) -> dict[str, Tensor]:
    """Parameter name -> this rank's shard (or the full tensor without sharding), plus the persistent buffers.

    The shard is the optimizer's copy (the fp32 master under mixed precision). Used to save and, as the
    destination that DCP fills in place, to load.
    """
    tensors: dict[str, Tensor] = {}
    if shards is not None:
        for shard in shards:
            tensors[shard.name] = shard_dtensor(shard.local.detach(), shard.spec, mesh)
    else:
        for name, param in module.named_parameters():
            tensors[name] = param.detach().view(to_shape(param.shape))
    tensors.update(persistent_buffers(module))
    return tensors


def persistent_buffers(module: nn.Module) -> dict[str, Tensor]:
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if k not in params and torch.is_tensor(v)}


def optimizer_tensors(sharded: ShardedOptimizer, mesh: DeviceMesh) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, per-element entries as shard DTensors; and its groups."""
    state_dict = sharded.optimizer.state_dict()
    shards = sharded.shards
    state: dict[str, dict[str, Any]] = {}
    for index, entry in state_dict["state"].items():
        shard = shards[index]
        state[shard.name] = {
            key: shard_dtensor(value, shard.spec, mesh) if is_per_element(key, value, shard.spec.local_shape, shard)
            else value
            for key, value in entry.items()
        }
    groups = [dict(g, params=[shards[i].name for i in g["params"]]) for g in state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}


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


def load_optimizer(sharded: ShardedOptimizer, loaded: dict[str, dict[str, Tensor]], groups: list[dict]) -> None:
    """Hand state loaded by name to the live optimizer (which keys its state by position)."""
    shards = sharded.shards
    position = {shard.name: i for i, shard in enumerate(shards)}
    names = [n for g in groups for n in g["params"]]
    if sorted(names) != sorted(position):
        raise CheckpointError(
            f"the checkpoint's {type(sharded.optimizer).__name__} steps {sorted(set(names) ^ set(position))} "
            "differently from this one"
        )
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


# ----------------------------------------------------------------------------------------------------------- save


def save_sharded(
    path: str | os.PathLike,
    checkpoint: dict[str, Any],
    module: nn.Module,
    shards: list[ParamShard] | None,
    facts: dict[str, Any],
    comms,
) -> None:
    """Save Lightning's ``checkpoint`` whose ``state_dict`` and ``optimizer_states`` hold this rank's shards (as
    ``model_tensors`` and ``optimizer_tensors`` make them): the tensors through DCP, the rest in ``lightning.pt``."""
    tensors = {"model": checkpoint.pop("state_dict")}
    optimizer_states = checkpoint.pop("optimizer_states", None)
    if optimizer_states is not None:
        tensors["optim"] = {str(i): state["state"] for i, state in enumerate(optimizer_states)}
    keys, aliases = state_dict_keys(module)
    if shards is not None:
        shapes = {s.name: tuple(s.spec.shape) for s in shards}
    else:
        shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    checkpoint[FORMAT_KEY] = dict(
        facts,
        version=1,
        shapes=shapes,
        aliases=aliases,
        state_dict_keys=keys,
        optimizer_param_groups=None if optimizer_states is None else [s["param_groups"] for s in optimizer_states],
    )
    save(path, tensors, checkpoint, comms)


def save(path: str | os.PathLike, tensors: dict[str, Any], meta: dict[str, Any], comms) -> None:
    """Write ``tensors`` (DCP) and ``meta`` (rank 0) atomically to the directory ``path``. All ranks call this."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if comms.rank == 0:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    comms.barrier()
    dcp.save(tensors, checkpoint_id=partial, process_group=comms.group)
    if comms.rank == 0:
        torch.save(meta, partial / META_FILE)
    comms.barrier()
    if comms.rank == 0:
        old = path.with_name(path.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            path.rename(old)
        partial.rename(path)
        if old.exists():
            shutil.rmtree(old)
    comms.barrier()


def remove(path: str | os.PathLike) -> None:
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


# ----------------------------------------------------------------------------------------------------------- load


def read_meta(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    resolved = _resolve(Path(path))
    if resolved is None:
        raise CheckpointError(f"{path} is not a lightning_zero checkpoint directory (no {META_FILE} in it)")
    return resolved, torch.load(resolved / META_FILE, weights_only=False, map_location="cpu")


def check_files(path: Path) -> dict[str, TensorStorageMetadata]:
    """Every shard file the checkpoint refers to exists and is long enough; returns the tensors' metadata."""
    reader = FileSystemReader(path)
    metadata = reader.read_metadata()
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint shard file {file} is missing")
        if file.stat().st_size < size:
            raise CheckpointError(
                f"checkpoint shard file {file} is truncated: {file.stat().st_size} bytes, the checkpoint needs {size}"
            )
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def check_compatible(expected: dict[str, torch.Size], stored: dict[str, TensorStorageMetadata], prefix: str) -> None:
    """Raise, naming every missing, unexpected and mis-shaped key, unless the model matches the checkpoint."""
    found = {k[len(prefix) :]: torch.Size(v.size) for k, v in stored.items() if k.startswith(prefix)}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshaped = sorted(
        f"{k}: checkpoint {tuple(found[k])}, model {tuple(expected[k])}"
        for k in set(expected) & set(found)
        if found[k] != expected[k]
    )
    if missing or unexpected or misshaped:
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {missing}")
        if unexpected:
            problems.append(f"not in the model: {unexpected}")
        if misshaped:
            problems.append(f"shapes differ: {misshaped}")
        raise CheckpointError("the checkpoint does not match this model; " + "; ".join(problems))


def load_sharded(
    path: str | os.PathLike,
    module: nn.Module,
    shards: list[ParamShard] | None,
    optimizers: list[ShardedOptimizer],
    mesh: DeviceMesh | None,
    comms,
) -> dict[str, Any]:
    """Read a checkpoint directory into ``shards`` (or the full parameters without sharding) and ``optimizers``.

    Everything is checked first (files present and complete, names and shapes matching), so a bad checkpoint
    changes nothing. Returns Lightning's part of the checkpoint, for Lightning to restore its own state from.
    """
    path, meta = read_meta(path)
    info = meta.pop(FORMAT_KEY)
    stored = check_files(path)
    model = model_tensors(module, shards, mesh)
    check_compatible({k: v.shape for k, v in model.items()}, stored, "model.")
    tensors: dict[str, Any] = {"model": model}
    groups = info["optimizer_param_groups"]
    if groups is not None and optimizers:
        if len(groups) != len(optimizers):
            raise CheckpointError(
                f"the checkpoint has {len(groups)} optimizer(s), configure_optimizers returned {len(optimizers)}"
            )
        tensors["optim"] = {
            str(i): optimizer_destinations(o, stored, f"optim.{i}.", mesh) for i, o in enumerate(optimizers)
        }
    dcp.load(tensors, checkpoint_id=path, process_group=comms.group if comms.distributed else None,
             no_dist=not comms.distributed)
    if "optim" in tensors:
        for i, optimizer in enumerate(optimizers):
            load_optimizer(optimizer, tensors["optim"][str(i)], groups[i])
    if groups is not None:
        meta["optimizer_states"] = []  # restored above; present so that Lightning does not report it missing
    meta["state_dict"] = {}
    return meta


# ---------------------------------------------------------------------------------------------------- consolidate

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def consolidate(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    dtype: torch.dtype | None = None,
    strip_prefix: str = "",
    training_state: bool = False,
) -> list[str]:
    """Write the full weights of a sharded checkpoint to one file that plain PyTorch loads; returns the keys written.

    ``.safetensors`` output holds the weights only and is streamed tensor by tensor (peak memory about the largest
    tensor). Any other suffix writes a Lightning checkpoint file, ``{"state_dict": ..., "hyper_parameters": ...}``,
    which ``LightningModule.load_from_checkpoint`` and ``module.load_state_dict(torch.load(out)["state_dict"])``
    accept, holding the weights in memory while writing; with ``training_state=True`` it also carries the full
    optimizer states and Lightning's loop, callback and scheduler state, so ``Trainer(strategy="ddp").fit(
    ckpt_path=out)`` (or a single device) resumes from it. Floating-point weights are cast to ``dtype`` if given; tied
    weights are written under every name. Runs in one process, with no process group.
    """
    path, meta = read_meta(checkpoint)
    info = meta[FORMAT_KEY]
    stored = check_files(path)
    items = [(key, source, stored[f"model.{source}"]) for key, source in _state_dict_names(info)]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    keys = [key[len(strip_prefix) :] if key.startswith(strip_prefix) else key for key, _, _ in items]
    if out.suffix == ".safetensors":
        if training_state:
            raise ValueError("training_state needs a .ckpt or .pt output: safetensors holds weights only")
        _write_safetensors(path, out, items, keys, info, dtype)
        return keys
    payload = {k: v for k, v in meta.items() if k != FORMAT_KEY} if training_state else {
        k: meta[k] for k in ("hyper_parameters", "hparams_name", "hparams_type", "pytorch-lightning_version") if k in meta
    }
    payload["state_dict"] = {k: _read_full(path, f"model.{source}", info, dtype, source) for k, (_, source, _) in zip(keys, items)}
    if training_state and info["optimizer_param_groups"] is not None:
        payload["optimizer_states"] = [
            _full_optimizer_state(path, stored, info, i, groups) for i, groups in enumerate(info["optimizer_param_groups"])
        ]
    torch.save(payload, out)
    return keys


def _full_optimizer_state(path: Path, stored, info, index: int, groups: list[dict]) -> dict[str, Any]:
    """Optimizer ``index``'s state as ``optimizer.state_dict()`` of the same optimizer over the full model."""
    names = [n for g in groups for n in g["params"]]
    state: dict[int, dict[str, Tensor]] = {}
    for position, name in enumerate(names):
        head = f"optim.{index}.{name}."
        for key in stored:
            if key.startswith(head) and "." not in key[len(head) :]:
                value = _read_full(path, key, info, None, name)
                state.setdefault(position, {})[key[len(head) :]] = value
    counter = iter(range(len(names)))
    return {"state": state, "param_groups": [dict(g, params=[next(counter) for _ in g["params"]]) for g in groups]}


def _state_dict_names(info: dict[str, Any]) -> list[tuple[str, str]]:
    """``(state_dict key, stored key)`` in the module's state_dict order, aliases of tied weights included."""
    return [(key, info["aliases"].get(key, key)) for key in info["state_dict_keys"]]


def _read_full(path: Path, key: str, info: dict[str, Any], dtype: torch.dtype | None, param: str) -> Tensor:
    """One stored tensor in full (a parameter's, or a per-element optimizer state's, back at the parameter's shape)."""
    meta = FileSystemReader(path).read_metadata().state_dict_metadata[key]
    tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load({key: tensor}, checkpoint_id=path, no_dist=True)
    shape = info["shapes"].get(param)
    if shape is not None and tensor.shape == to_shape(shape):
        tensor = tensor.view(shape)
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _write_safetensors(path: Path, out: Path, items, keys: list[str], info, dtype: torch.dtype | None) -> None:
    header: dict[str, Any] = {}
    offset = 0
    for key, (_, source, meta) in zip(keys, items):
        stored_dtype = meta.properties.dtype
        target = dtype if dtype is not None and stored_dtype.is_floating_point else stored_dtype
        shape = list(info["shapes"].get(source, meta.size))
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=target).element_size()
        header[key] = {"dtype": _SAFETENSORS_DTYPES[target], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    partial = out.with_name(out.name + ".partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, source, _ in items:
            tensor = _read_full(path, f"model.{source}", info, dtype, source).contiguous()
            f.write(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
            del tensor
    partial.replace(out)


def state_dict_keys(module: nn.Module) -> tuple[list[str], dict[str, str]]:
    """The module's state_dict keys and, for tied weights, each alias's first name (the one that is stored)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return list(module.state_dict(keep_vars=True).keys()), aliases
