"""Consolidation: the full weights (and optionally the full training state) of a sharded checkpoint in one file
that plain PyTorch loads, written in one process with no process group, one tensor at a time."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader

from lightning_zero.checkpoint.layout import FORMAT_KEY, check_files, read_meta, to_shape

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
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for _, source, _ in items:
                tensor = _read_full(path, f"model.{source}", info, dtype, source).reshape(-1)
                f.write(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
                del tensor
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
