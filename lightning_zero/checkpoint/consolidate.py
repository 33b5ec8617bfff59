"""Consolidation: the full weights (and optionally the full training state) of a checkpoint in one file that plain
PyTorch loads, written in one process with no process group, one tensor at a time.

A checkpoint file already is one (see [Note: checkpoint layout]): consolidating it checks every byte, and writes the
weights alone, as safetensors or cast to another dtype. A checkpoint directory of the earlier format (see
[Note: checkpoint directories]) is read tensor by tensor through DCP.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader

from lightning_zero.checkpoint.layout import (
    FORMAT_KEY,
    CheckpointError,
    check_files,
    is_checkpoint_directory,
    read_meta,
    to_shape,
)
from lightning_zero.checkpoint.sharded import damaged_range, format_info, open_checkpoint

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
#: Lightning's checkpoint keys for the precision plugin's state (the fp16 loss scaler): ours, and DDP's.
_PRECISION_KEYS = ("ZeroMixedPrecision", "ZeroPrecision")
_DDP_PRECISION_KEY = "MixedPrecision"
_WEIGHTS_KEYS = ("hyper_parameters", "hparams_name", "hparams_type", "pytorch-lightning_version")

#: One tensor to write: its key, its full shape and stored dtype, and how to read it.
_Entry = tuple[str, torch.Size, torch.dtype, Callable[[], Tensor]]


def consolidate(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    dtype: torch.dtype | None = None,
    strip_prefix: str = "",
    training_state: bool = False,
) -> list[str]:
    """Write the full weights of a checkpoint to one file that plain PyTorch loads; returns the keys written.

    ``.safetensors`` output holds the weights only and is streamed tensor by tensor (peak memory about the largest
    tensor). Any other suffix writes a Lightning checkpoint file, ``{"state_dict": ..., "hyper_parameters": ...}``,
    which ``LightningModule.load_from_checkpoint`` and ``module.load_state_dict(torch.load(out)["state_dict"])``
    accept, holding the weights in memory while writing; with ``training_state=True`` it also carries the full
    optimizer states and Lightning's loop, callback and scheduler state, so ``Trainer(strategy="ddp").fit(
    ckpt_path=out)`` (or a single device) resumes from it. Floating-point weights are cast to ``dtype`` if given; tied
    weights are written under every name. Every byte is checked against the checkpoint's checksums first. Runs in
    one process, with no process group.
    """
    out = Path(out)
    if out.suffix == ".safetensors" and training_state:
        raise ValueError("training_state needs a .ckpt or .pt output: safetensors holds weights only")
    if is_checkpoint_directory(checkpoint):
        meta, entries, optimizer_states = _directory_contents(Path(checkpoint))
    elif Path(checkpoint).is_file():
        meta, entries, optimizer_states = _file_contents(Path(checkpoint))
    else:
        raise CheckpointError(f"{checkpoint} is not a checkpoint: there is no such file or checkpoint directory")
    entries = [(_strip(key, strip_prefix), shape, stored, read) for key, shape, stored, read in entries]
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        _write_safetensors(out, entries, dtype)
        return [key for key, *_ in entries]
    payload = {k: v for k, v in meta.items() if k not in ("state_dict", "optimizer_states")} if training_state else {
        k: meta[k] for k in _WEIGHTS_KEYS if k in meta
    }
    for key in _PRECISION_KEYS:  # the loss scaler's state, where DDP's MixedPrecision plugin looks for it
        if key in payload:
            payload[_DDP_PRECISION_KEY] = payload.pop(key)
    payload["state_dict"] = {key: _cast(read(), dtype) for key, _, _, read in entries}
    if training_state and optimizer_states is not None:
        payload["optimizer_states"] = optimizer_states()
    torch.save(payload, out)
    return list(payload["state_dict"])


def _strip(key: str, prefix: str) -> str:
    return key[len(prefix) :] if prefix and key.startswith(prefix) else key


def _cast(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _file_contents(path: Path) -> tuple[dict[str, Any], list[_Entry], Callable[[], list] | None]:
    """A checkpoint file, mapped, after checking all of it (every saved range of ours; DDP's have no table)."""
    checkpoint = open_checkpoint(path, weights_only=False)
    if format_info(checkpoint) is not None:
        found = damaged_range(path, checkpoint, rank=0, world_size=1)
        if found is not None:
            raise CheckpointError(f"checkpoint file {path} is corrupt: {found[1]}")
        checkpoint.pop(FORMAT_KEY)
    entries = [
        (key, value.shape, value.dtype, (lambda value=value: value))
        for key, value in checkpoint["state_dict"].items()
        if torch.is_tensor(value)
    ]
    states = checkpoint.get("optimizer_states")
    return checkpoint, entries, (lambda: states) if states is not None else None


def _directory_contents(path: Path) -> tuple[dict[str, Any], list[_Entry], Callable[[], list] | None]:
    """A checkpoint directory of the earlier format, after checking every file; tensors read one at a time."""
    path, meta = read_meta(path)
    info = meta.pop(FORMAT_KEY)
    stored = check_files(path)
    entries = []
    for key, source in _state_dict_names(info):
        size = torch.Size(info["shapes"].get(source, stored[f"model.{source}"].size))
        stored_dtype = stored[f"model.{source}"].properties.dtype
        read = lambda source=source: _read_full(path, f"model.{source}", info, source)  # noqa: E731
        entries.append((key, size, stored_dtype, read))
    groups = info["optimizer_param_groups"]
    optimizer_states = None
    if groups is not None:
        def optimizer_states() -> list:
            return [_full_optimizer_state(path, stored, info, i, g) for i, g in enumerate(groups)]
    return meta, entries, optimizer_states


def _full_optimizer_state(path: Path, stored, info, index: int, groups: list[dict]) -> dict[str, Any]:
    """Optimizer ``index``'s state as ``optimizer.state_dict()`` of the same optimizer over the full model."""
    names = [n for g in groups for n in g["params"]]
    state: dict[int, dict[str, Tensor]] = {}
    for position, name in enumerate(names):
        head = f"optim.{index}.{name}."
        for key in stored:
            if key.startswith(head) and "." not in key[len(head) :]:
                value = _read_full(path, key, info, name)
                state.setdefault(position, {})[key[len(head) :]] = value
    counter = iter(range(len(names)))
    return {"state": state, "param_groups": [dict(g, params=[next(counter) for _ in g["params"]]) for g in groups]}


def _state_dict_names(info: dict[str, Any]) -> list[tuple[str, str]]:
    """``(state_dict key, stored key)`` in the module's state_dict order, aliases of tied weights included."""
    return [(key, info["aliases"].get(key, key)) for key in info["state_dict_keys"]]


def _read_full(path: Path, key: str, info: dict[str, Any], param: str) -> Tensor:
    """One stored tensor in full (a parameter's, or a per-element optimizer state's, back at the parameter's shape)."""
    meta = FileSystemReader(path).read_metadata().state_dict_metadata[key]
    tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load({key: tensor}, checkpoint_id=path, no_dist=True)
    shape = info["shapes"].get(param)
    if shape is not None and tensor.shape == to_shape(shape):
        tensor = tensor.view(shape)
    return tensor


def _write_safetensors(out: Path, entries: list[_Entry], dtype: torch.dtype | None) -> None:
    """The safetensors file, header first, then each tensor read, cast and written in turn (to ``out.partial``,
    renamed at the end)."""
    header: dict[str, Any] = {}
    offset = 0
    for key, shape, stored_dtype, _ in entries:
        target = dtype if dtype is not None and stored_dtype.is_floating_point else stored_dtype
        nbytes = shape.numel() * torch.empty(0, dtype=target).element_size()
        header[key] = {
            "dtype": _SAFETENSORS_DTYPES[target], "shape": list(shape), "data_offsets": [offset, offset + nbytes]
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    partial = out.with_name(out.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for _, _, _, read in entries:
                tensor = _cast(read(), dtype).contiguous().reshape(-1)
                f.write(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
                del tensor
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
