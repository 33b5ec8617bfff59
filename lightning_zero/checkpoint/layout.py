"""What a checkpoint holds, and the checks made on one before anything is read.

[Note: checkpoint layout]
A checkpoint is one file at the path Lightning hands out (``trainer.save_checkpoint(path)``, ``ModelCheckpoint``'s
``best_model_path``, ``last.ckpt``), in ``torch.save``'s format, holding exactly what a DDP checkpoint holds:
Lightning's dictionary with ``state_dict`` (every parameter at its full shape under every name the module's
``state_dict`` has, tied weights sharing one storage, the fp32 master under mixed precision; the persistent buffers
as rank 0 holds them, as DDP's checkpoints hold rank 0's) and ``optimizer_states`` (each optimizer's
``state_dict()``, position-keyed, moments at full shape), loops, callbacks, schedulers, hyper-parameters and the
loss scaler, plus one key of ours, ``lightning_zero`` (the stage, world size and precision it was saved with, the
optimizer classes, and the checksums below; under hybrid sharding the world size is the shard group's, whose ranks
wrote the rows: see [Note: hybrid sharding] in sharding/topology.py). So ``torch.load(path)``, ``Model.load_from_checkpoint(path)`` and
``Trainer(strategy="ddp").fit(ckpt_path=path)`` read it as they read a DDP checkpoint, with no lightning_zero
installed; a model too large for one process's memory maps it instead (``torch.load(path, mmap=True)``).

It is written sharded: every rank writes the rows it owns of every parameter and per-element optimizer state into
the one file, in parallel (see [Note: one checkpoint file, written by every rank] in torch_file.py). A load maps the
file and each rank reads only the rows it now owns, at any world size and stage; DDP and single-device checkpoints
load the same way. Saving is atomic: everything goes to ``<path>.partial``, renamed to ``<path>`` (``os.replace``)
once every rank's rows are on disk and checksummed, so a rank dying mid-save leaves the previous checkpoint at
``<path>``. Loading is checked first: the file, the names and shapes against the model and the optimizer state
against the optimizers, on every rank, before any live tensor is overwritten.

[Note: checksums]
The zip archive carries a CRC-32 of every record that ``torch.save``'s writer wrote (the pickle, buffers, counters),
but a placeholder's record is written by the ranks, so its zip CRC-32 is left 0. Each rank computes the CRC-32 of the
bytes it writes (one range per tensor: its rows) while writing them; rank 0 writes the table of them, one entry per
(tensor, rank) range, into the file as the last thing before the rename (``lightning_zero["crc32"]``, with
``lightning_zero["ranges"]`` saying which range each entry covers). A load checks the pickle's zip CRC-32 before
unpickling, the other records ``torch.save`` wrote, and, on each rank, every saved range that overlaps the rows it is
about to read; the ranks agree on the outcome, so a damaged file fails on every rank, naming the tensor and the
bytes, with nothing changed. ``consolidate`` checks everything. CRC-32 runs at ~3.7 GB/s on one core here (blake2b
0.4, sha256 1.2): it catches damage, not tampering. DDP checkpoints have no table and load unchecked.

[Note: checkpoint directories]
Before checkpoints were one file, lightning_zero wrote directories (``legacy.py`` still loads and consolidates
them)::

    .metadata, __*_*.distcp   torch.distributed.checkpoint (DCP): every rank wrote only the rows it owned
    lightning.pt              rank 0: Lightning's own state and ours (parameter shapes, tied-weight aliases, groups)
    checksums.json            size and CRC-32 of every file, and of the manifest itself (absent in the oldest)

DCP holds ``model.<name>`` for every parameter and persistent buffer at its full shape (a 0-d parameter as shape
``(1,)``) and ``optim.<i>.<name>.<key>`` for optimizer ``i``'s state, keyed by parameter name. A shard is handed to
DCP as a ``DTensor`` placed ``Shard(0)``, whose row split is exactly ours (chunks of ``ceil(rows / N)``), so DCP
reshards on load. A directory interrupted mid-swap is found at ``<path>.old``. A load checks ``lightning.pt`` and
``.metadata`` against the manifest before unpickling them, then each rank the shard files it will read (DCP's own
load plan says which), and the ranks agree before anything is read.
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


def is_checkpoint_directory(path: str | os.PathLike) -> bool:
    """A checkpoint directory of the format before checkpoints were one file (see [Note: checkpoint directories])."""
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
        raise CheckpointError(f"{resolved / META_FILE} cannot be read: {first_line(err)}") from err


def read_dcp_metadata(path: Path) -> Metadata:
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as err:
        raise CheckpointError(f"{path / DCP_META_FILE} cannot be read: {first_line(err)}") from err


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
        raise CheckpointError(f"checkpoint manifest {file} is damaged: {first_line(err)}") from err
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


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def stored_shapes(stored: dict[str, TensorStorageMetadata], prefix: str) -> dict[str, torch.Size]:
    """Name -> shape of the DCP entries under ``prefix`` (a checkpoint directory's)."""
    return {k[len(prefix) :]: torch.Size(v.size) for k, v in stored.items() if k.startswith(prefix)}


def check_compatible(expected: dict[str, torch.Size], found: dict[str, torch.Size], names: bool = True) -> None:
    """Raise, naming every missing, unexpected (with ``names``) and mis-shaped key, unless the model matches the
    checkpoint."""
    missing = sorted(set(expected) - set(found)) if names else []
    unexpected = sorted(set(found) - set(expected)) if names else []
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


def check_optimizer_class(saved: str | None, live: Any, index: int) -> None:
    """The checkpoint's optimizer ``index`` is of the live one's class (by name; checkpoints that did not record it
    skip this). Another class would be handed state it does not use (Adam's moments in SGD) and hyper-parameter
    groups without its own keys; another precision, other hyper-parameter values, world size or stage are fine."""
    name = type(live).__name__
    if saved is not None and saved != name:
        raise CheckpointError(
            f"optimizer {index}: the checkpoint holds the state of {saved}, configure_optimizers returned {name}; "
            "to start a new optimizer from these weights, load only the state_dict"
        )


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
