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

[Note: checksums]
DCP checks no tensor bytes: a shard file with flipped bytes loads as other numbers. So a save also writes
``checksums.json``: the size and CRC-32 of every file (``.metadata``, ``lightning.pt`` and each ``.distcp``), plus the
CRC-32 of the manifest itself. Each rank hashes a round-robin share of the files right after writing them and rank 0
writes the manifest, inside ``<path>.partial``, so it is swapped in with the rest. A load checks ``lightning.pt`` and
``.metadata`` before unpickling them, then each rank the shard files it will read (DCP's own load plan says which),
and the ranks agree on the outcome before anything is read: a damaged file fails on every rank, naming the file,
with nothing changed. ``consolidate`` checks every file. CRC-32 runs at ~3.7 GB/s on one core here (blake2b 0.4,
sha256 1.2): it catches damage, not tampering. Checkpoints written before the manifest existed have none and load
without the check.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from lightning_zero.sharding.flat_param import ShardSpec

META_FILE = "lightning.pt"
FORMAT_KEY = "lightning_zero"
DCP_META_FILE = ".metadata"
MANIFEST_FILE = "checksums.json"
_HASH_CHUNK = 16 * 2**20


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
    """This rank's rows of a tensor of ``spec.shape``, as the ``Shard(0)`` DTensor DCP stores and reshards.

    The DTensor wraps ``local`` itself, wherever it lives, as FSDP2's offloaded shards do: ``DTensor.from_local``
    would move it to the mesh's device, so that saving or loading an offloaded run would copy every fp32 master and
    optimizer moment (12Ψ/N) to the GPU, the memory offload exists to spare, and a file-backed (disk offload) one
    into memory. DCP reads and writes the local tensor where it is."""
    shape = to_shape(spec.shape)
    stride = torch.empty(shape, device="meta").stride()
    local = local.reshape(spec.local_rows, *shape[1:])
    meta = TensorMeta(shape, stride, local.dtype)
    return DTensor(local, DTensorSpec(mesh, (Shard(0),), tensor_meta=meta), requires_grad=False)


def remove(path: str | os.PathLike) -> None:
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)




def read_meta(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory and its ``lightning.pt``, both small files checked against the manifest first."""
    resolved = _resolve(Path(path))
    if resolved is None:
        raise CheckpointError(f"{path} is not a lightning_zero checkpoint directory (no {META_FILE} in it)")
    manifest = read_manifest(resolved)
    if manifest is not None:
        raise_if_damaged(resolved, manifest, [META_FILE, DCP_META_FILE])
    try:
        return resolved, torch.load(resolved / META_FILE, weights_only=False, map_location="cpu")
    except Exception as err:
        raise CheckpointError(f"{resolved / META_FILE} cannot be read: {_first_line(err)}") from err


def read_dcp_metadata(path: Path) -> Metadata:
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as err:
        raise CheckpointError(f"{path / DCP_META_FILE} cannot be read: {_first_line(err)}") from err


def check_files(path: Path, verify: bool = True) -> dict[str, TensorStorageMetadata]:
    """Every shard file the checkpoint refers to exists and is long enough, and, with ``verify`` and a manifest,
    matches its checksum (see [Note: checksums]); returns the tensors' metadata."""
    metadata = read_dcp_metadata(path)
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
    manifest = read_manifest(path) if verify else None
    if manifest is not None:
        raise_if_damaged(path, manifest, sorted(needed))
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


# --------------------------------------------------------------------------------------------------- checksums


def file_checksum(file: Path) -> int:
    """CRC-32 of a file, read in 16 MiB pieces."""
    crc, buffer = 0, bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


def checksummed_files(metadata: Metadata) -> list[str]:
    """The files a manifest covers, in the order every rank uses: ``.metadata``, ``lightning.pt``, the shards."""
    shards = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return sorted({DCP_META_FILE, META_FILE} | shards)


def write_manifest(path: Path, checksums: dict[str, int]) -> None:
    """Write ``checksums.json`` for the files named in ``checksums`` (name -> CRC-32), their sizes taken now."""
    files = {name: {"bytes": (path / name).stat().st_size, "crc32": crc} for name, crc in sorted(checksums.items())}
    body = {"version": 1, "algorithm": "crc32", "files": files}
    body["crc32"] = zlib.crc32(_canonical(body))
    (path / MANIFEST_FILE).write_text(json.dumps(body, indent=1, sort_keys=True))


def read_manifest(path: Path) -> dict[str, tuple[int, int]] | None:
    """File name -> (bytes, CRC-32) from ``checksums.json``; None for a checkpoint saved without one."""
    file = path / MANIFEST_FILE
    if not file.is_file():
        return None
    try:
        body = json.loads(file.read_text())
        recorded = body.pop("crc32")
        intact = recorded == zlib.crc32(_canonical(body)) and body["algorithm"] == "crc32"
        files = {name: (int(e["bytes"]), int(e["crc32"])) for name, e in body["files"].items()} if intact else {}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"checkpoint manifest {file} is damaged: {_first_line(err)}") from err
    if not intact:
        raise CheckpointError(f"checkpoint manifest {file} is damaged: its content does not match its own checksum")
    return files


def file_damage(path: Path, manifest: dict[str, tuple[int, int]], name: str) -> str | None:
    """What is wrong with file ``name`` against the manifest, or None if it matches."""
    file = path / name
    if name not in manifest:
        return f"checkpoint file {file} is not in the manifest {path / MANIFEST_FILE}"
    size, crc = manifest[name]
    if not file.is_file():
        return f"checkpoint file {file} is missing"
    if file.stat().st_size != size:
        return f"checkpoint file {file} has {file.stat().st_size} bytes, {size} when it was saved"
    if file_checksum(file) != crc:
        return f"checkpoint file {file} is corrupt: its CRC-32 differs from the one recorded when it was saved"
    return None


def raise_if_damaged(path: Path, manifest: dict[str, tuple[int, int]], names: Iterable[str]) -> None:
    for name in names:
        problem = file_damage(path, manifest, name)
        if problem is not None:
            raise CheckpointError(problem)


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


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
