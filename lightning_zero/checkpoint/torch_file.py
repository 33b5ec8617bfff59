"""A ``torch.save`` file laid out by one rank and filled by all: the container of a checkpoint.

[Note: one checkpoint file, written by every rank]
A checkpoint is one regular file in ``torch.save``'s format (a zip archive of uncompressed, 64-byte aligned
records: ``data.pkl``, the pickle of the object, and ``data/<key>``, the bytes of each tensor storage it refers
to), so that ``torch.load``, ``LightningModule.load_from_checkpoint`` and any tool that opens a Lightning checkpoint
read it, with lightning_zero installed or not. What makes it sharded is how it is written:

1. Rank 0 pickles the object, in which every tensor the ranks hold in shards stands as a ``Placeholder`` (its full
   shape and dtype, no data), and writes the archive with the placeholders' records reserved but not written
   (``write_layout``; the archive's end, its central directory, comes after them). The other tensors (buffers,
   step counters, callback state) are written as ``torch.save`` writes them.
2. Each rank learns the byte offset of every placeholder's record and writes its own rows there (``write_rows``):
   a tensor is split on dim 0 and stored row-major, so a rank's rows are one contiguous byte range of the record,
   written with ``pwrite``, in parallel with the other ranks, never touching another rank's bytes.

The reserving uses the writer torch.save itself uses (``torch._C.PyTorchFileWriter``): ``write_record_metadata``,
which ``torch.serialization.skip_data`` is built on, reserves a record's space; torch releases without it get the
record written as zeros by rank 0 first. The pickler mirrors ``torch.serialization._save``'s: the same persistent ids
for storages and the same records, so the file is what ``torch.save`` would have written of the full object, except
that the zip's own CRC-32 field of a placeholder's record is 0 (as with ``torch.serialization.set_crc32_options(
False)``: ``torch.load`` does not read it). Those bytes are covered by the checkpoint's own CRC-32 table instead
(see [Note: checksums] in layout.py).
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import sys
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.serialization import location_tag, normalize_storage_type

_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL
_ALIGNMENT = 64  # torch.save's storage alignment
_WRITE_CHUNK = 64 * 2**20  # bytes copied to the host and written at a time


@dataclass(eq=False)
class Placeholder:
    """A tensor of ``shape`` and ``dtype`` in the pickled object whose bytes the ranks write after the layout.

    Pickled as ``torch.save`` pickles a contiguous CPU tensor, so the file loads as that tensor. One placeholder
    appearing twice in the object (a tied weight under two names) is one storage in the file, as with ``torch.save``.
    """

    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.numel * _element_size(self.dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of dim 0 (of the one element of a 0-d tensor)."""
        rows = self.shape[0] if len(self.shape) > 0 else 1
        return self.nbytes // rows if rows else 0

    def __reduce_ex__(self, protocol: int) -> Any:
        stride = torch.empty(self.shape, device="meta").stride()
        storage = _Storage(self)
        if self.dtype in torch.storage._new_dtypes():
            args = (storage, 0, tuple(self.shape), stride, False, collections.OrderedDict(), self.dtype)
            return torch._utils._rebuild_tensor_v3, args
        args = (storage, 0, tuple(self.shape), stride, False, collections.OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


@dataclass(frozen=True, eq=False)
class _Storage:
    """The storage of a placeholder, as the pickler's persistent id sees it."""

    placeholder: Placeholder


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def write_layout(path: str | os.PathLike, obj: Any, placeholders: Sequence[Placeholder]) -> list[int]:
    """Write ``obj`` to ``path`` in ``torch.save``'s format with the records of ``placeholders`` reserved, not
    written; return the byte offset in the file of each placeholder's data, in order. Placeholder ``i`` is record
    ``data/<i>``; the other storages follow in the order the pickle meets them."""
    records: dict[str, tuple[Any, int]] = {str(i): (None, p.nbytes) for i, p in enumerate(placeholders)}
    index = {id(p): str(i) for i, p in enumerate(placeholders)}
    storages: dict[int, str] = {}

    def persistent_id(obj: Any) -> tuple | None:
        if isinstance(obj, _Storage):
            p = obj.placeholder
            if id(p) not in index:
                raise ValueError(f"a placeholder of shape {tuple(p.shape)} is not among the ones the layout reserves")
            if p.dtype in torch.storage._new_dtypes():
                return ("storage", torch.UntypedStorage, index[id(p)], "cpu", p.nbytes)
            kind = getattr(torch, torch.storage._dtype_to_storage_type_map()[p.dtype])
            return ("storage", kind, index[id(p)], "cpu", p.numel)
        if isinstance(obj, torch.storage.TypedStorage):
            storage, kind, numel = obj._untyped_storage, getattr(torch, obj._pickle_storage_type()), obj._size()
        elif torch.is_storage(obj):
            storage, kind, numel = obj, normalize_storage_type(type(obj)), obj.nbytes()
        else:
            return None
        key = storages.get(storage._cdata)
        if key is None:
            key = storages[storage._cdata] = str(len(records))
            records[key] = (storage, storage.nbytes())
        return ("storage", kind, key, location_tag(storage), numel)

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> tuple | None:
            return persistent_id(obj)

    buffer = io.BytesIO()
    Pickler(buffer, protocol=_PROTOCOL).dump(obj)
    with open(path, "wb") as stream:
        writer = _writer(stream)
        _write_record(writer, "data.pkl", buffer.getvalue())
        _write_record(writer, ".format_version", b"1")
        _write_record(writer, ".storage_alignment", str(_ALIGNMENT).encode())
        _write_record(writer, "byteorder", sys.byteorder.encode())
        for key, (storage, nbytes) in records.items():
            if storage is None:
                _reserve_record(writer, f"data/{key}", nbytes)
            else:
                writer.write_record(f"data/{key}", storage.cpu(), nbytes)
        writer.write_end_of_file()
    reader = torch._C.PyTorchFileReader(os.fspath(path))
    return [reader.get_record_offset(f"data/{i}") for i in range(len(placeholders))]


def _writer(stream) -> Any:
    try:
        return torch._C.PyTorchFileWriter(stream, True, _ALIGNMENT)
    except TypeError:  # torch releases whose writer takes no alignment (64 then)
        return torch._C.PyTorchFileWriter(stream)


def _write_record(writer: Any, name: str, data: bytes) -> None:
    writer.write_record(name, data, len(data))


def _reserve_record(writer: Any, name: str, nbytes: int) -> None:
    reserve = getattr(writer, "write_record_metadata", None)
    if reserve is not None:
        reserve(name, nbytes)
    else:
        writer.write_record(name, bytes(nbytes), nbytes)


def write_rows(fd: int, offset: int, rows: Tensor) -> int:
    """Write the bytes of ``rows`` (a contiguous block of a tensor's rows, on any device) at ``offset`` of the open
    file ``fd``, at most ``_WRITE_CHUNK`` bytes on the host at a time; return their CRC-32."""
    flat = rows.detach().reshape(-1)
    if flat.numel() == 0:
        return 0
    step = max(1, _WRITE_CHUNK // flat.element_size())
    crc = 0
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step].cpu().contiguous().view(torch.uint8).numpy()
        view = memoryview(chunk)
        crc = zlib.crc32(view, crc)
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], offset + written)
        offset += len(view)
    return crc


def read_crc(fd: int, offset: int, length: int) -> int:
    """CRC-32 of ``length`` bytes at ``offset`` of the open file ``fd``; raises EOFError if the file ends first."""
    crc, done = 0, 0
    while done < length:
        data = os.pread(fd, min(_WRITE_CHUNK, length - done), offset + done)
        if not data:
            raise EOFError(f"the file ends {length - done} bytes before the end of the range")
        crc = zlib.crc32(data, crc)
        done += len(data)
    return crc


def record_offsets(path: str | os.PathLike, count: int) -> list[int]:
    """Byte offsets of the data of records ``data/0`` ... ``data/<count - 1>``."""
    reader = torch._C.PyTorchFileReader(os.fspath(path))
    return [reader.get_record_offset(f"data/{i}") for i in range(count)]


def check_records(path: str | os.PathLike, wanted: Callable[[str], bool]) -> None:
    """Check the zip CRC-32 of every record whose name (``data.pkl``, ``data/3``, ...) is ``wanted``, reading it in
    full; raise ``ValueError`` naming the first that differs, or saying that the file is no complete archive."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise ValueError(f"it is not a complete torch.save archive ({err})") from err
    with archive:
        for info in archive.infolist():
            name = info.filename.split("/", 1)[-1]
            if not wanted(name):
                continue
            try:
                with archive.open(info) as record:
                    while record.read(_WRITE_CHUNK):
                        pass
            except (zipfile.BadZipFile, EOFError, OSError) as err:
                raise ValueError(f"its record {name} is corrupt ({err})") from err
