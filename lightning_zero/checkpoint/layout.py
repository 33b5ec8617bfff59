"""What a checkpoint directory holds, and the checks made on one before anything is read.

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

Persistent buffers are stored from rank 0 only, as DDP's checkpoints hold rank 0's (a BatchNorm's running statistics
may differ between ranks that do not broadcast them).

Saving is atomic: everything goes to ``<path>.partial``, which replaces ``<path>`` only once every rank has finished
(the previous checkpoint is moved to ``<path>.old`` for the instant of the swap). A rank dying mid-save leaves the
previous checkpoint at ``<path>`` untouched. Loading is atomic too: every file is checked, then everything is read
into fresh tensors, and only when all reads succeeded on every rank are the live shards, buffers and optimizer
states overwritten.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_zero.sharding.flat_param import ShardSpec

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




def shard_dtensor(local: Tensor, spec: ShardSpec, mesh: DeviceMesh) -> DTensor:
    """This rank's rows of a tensor of ``spec.shape``, as the ``Shard(0)`` DTensor DCP stores and reshards."""
    shape = to_shape(spec.shape)
    stride = torch.empty(shape, device="meta").stride()
    local = local.reshape(spec.local_rows, *shape[1:])
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def remove(path: str | os.PathLike) -> None:
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)




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
