"""Where a checkpoint file keeps what: byte ranges of its records and of the rows each rank wrote, for tests that
damage checkpoints on purpose."""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch


def record_range(path: Path, name: str) -> tuple[int, int]:
    """File offset and length of the record ``name`` (``data.pkl``, ``data/3``)."""
    offset = torch._C.PyTorchFileReader(str(path)).get_record_offset(name)
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.split("/", 1)[-1] == name)
    return offset, info.file_size


def data_records(path: Path) -> list[str]:
    """The ``data/<key>`` records, by key."""
    with zipfile.ZipFile(path) as archive:
        names = [i.filename.split("/", 1)[-1] for i in archive.infolist()]
    return sorted((n for n in names if n.startswith("data/")), key=lambda n: int(n.split("/")[1]))


def rows_range(path: Path, location: tuple, rank: int, world_size: int) -> tuple[int, int]:
    """File offset and length of the rows ``rank`` of ``world_size`` wrote of the sharded tensor at ``location``."""
    checkpoint = torch.load(path, mmap=True, weights_only=True)
    index = checkpoint["lightning_zero"]["tensors"].index(location)
    tensor = checkpoint
    for part in location:
        tensor = tensor[part]
    rows = tensor.shape[0] if tensor.dim() else 1
    row_bytes = tensor.numel() * tensor.element_size() // rows
    per_rank = -(-rows // world_size)
    lo, hi = min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)
    offset, _ = record_range(path, f"data/{1 + index}")
    return offset + lo * row_bytes, (hi - lo) * row_bytes


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0xFF]))
