"""Tensors kept in files: the storage disk offload streams from (see [Note: disk offload] in disk.py).

[Note: one file per tensor, read and written through buffers]
Each offloaded tensor is one preallocated file (``posix_fallocate``: a full disk is one clear error at creation, never
a failed write later) in a private directory. The training step never touches a file's pages through a mapping: it
reads a sub-group into buffers of its own with ``pread`` and writes it back with ``pwrite``, then flushes the file
(``fdatasync``) and drops its pages from the page cache (``POSIX_FADV_DONTNEED``), so that what a rank holds in memory
is its buffers, not the files: the page cache, which a cgroup's memory limit counts, does not grow with the model.

Everything else that reads or writes model state (checkpoints, ``load_state_dict``, consolidation, the end of fit)
works on ordinary tensors: each file is also mapped (``MAP_SHARED``) and ``FileStore.create`` returns the mapped
tensor, which costs address space only until something reads it. Reads and writes through the mapping and through
``pread``/``pwrite`` see the same pages (one page cache), and ``drop`` flushes pages dirtied either way before
releasing them, so such a rare access leaves nothing resident once the offload drops the files again. Buffered I/O
rather than ``O_DIRECT``: direct I/O would bypass the page cache altogether, but it needs aligned sizes, is refused by
some filesystems (tmpfs) and is not coherent with the mapping.
"""

from __future__ import annotations

import math
import mmap
import os
import shutil
from pathlib import Path

import torch
from torch import Tensor

from lightning_zero.watchdog import cancel_before_exit, run_before_exit

#: Bytes per pread/pwrite call (Linux moves at most about 2 GiB in one).
_IO_CHUNK = 1 << 30


class OffloadDiskError(RuntimeError):
    """The offload directory is missing, not writable or too small, or a file of it failed; the message names it."""


class _File:
    def __init__(self, path: Path, fd: int, mapped: mmap.mmap) -> None:
        self.path, self.fd, self.mapped = path, fd, mapped

    @property
    def nbytes(self) -> int:
        return len(self.mapped)


class FileStore:
    """Tensors backed by preallocated files in one private directory (see [Note: one file per tensor, read and
    written through buffers]); the directory and its files are removed by ``close``, or when the process ends."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: dict[int, _File] = {}  # storage pointer of the mapped tensor -> its file
        self._count = 0
        run_before_exit(self._remove_directory)  # a rank the watchdog ends leaves no files behind either

    def create(self, source: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """A new file holding ``source`` (cast to ``dtype``), written with ``pwrite`` and dropped from the page
        cache; returns the file's mapped tensor."""
        tensor = self.reserve(source.shape, dtype or source.dtype)
        if tensor.numel():
            file = self._files[tensor.untyped_storage().data_ptr()]
            self._pwrite(file, source.detach().to(device="cpu", dtype=tensor.dtype).contiguous())
            self._drop(file)
        return tensor

    def reserve(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """A new file of zeros for a tensor of ``shape`` and ``dtype``; returns its mapped tensor (an empty tensor
        has no file)."""
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        path = self.directory / f"t{self._count:06d}.bin"
        self._count += 1
        nbytes = numel * dtype.itemsize
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as err:
            raise OffloadDiskError(f"cannot create {path} for disk offload: {err.strerror}") from None
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as err:
            os.close(fd)
            raise OffloadDiskError(f"cannot reserve {nbytes} bytes in {path}: {err.strerror}") from None
        mapped = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        tensor = torch.frombuffer(mapped, dtype=dtype, count=numel).view(shape)
        self._files[tensor.untyped_storage().data_ptr()] = _File(path, fd, mapped)
        return tensor

    def holds(self, tensor: object) -> bool:
        return torch.is_tensor(tensor) and tensor.untyped_storage().data_ptr() in self._files

    def read(self, tensor: Tensor, into: Tensor) -> None:
        """Copy the file behind ``tensor`` into ``into`` (a contiguous tensor of its size) and drop its pages."""
        file = self._file(tensor)
        _check_size(file)
        view = _bytes(into)
        done = 0
        while done < len(view):
            count = os.preadv(file.fd, [view[done : done + _IO_CHUNK]], done)
            if count == 0:
                raise OffloadDiskError(f"{file.path} ended after {done} of {len(view)} bytes: something outside this "
                                       "run changed the offload directory")
            done += count
        os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def write(self, tensor: Tensor, source: Tensor) -> None:
        """Write ``source`` (contiguous, of ``tensor``'s size and dtype) into the file behind ``tensor``; flushed and
        dropped by ``drop``."""
        self._pwrite(self._file(tensor), source)

    def drop(self, tensors: list[Tensor]) -> None:
        """Flush the files behind ``tensors`` to disk and release their pages, from the page cache and from this
        process's mappings."""
        for tensor in tensors:
            file = self._files.get(tensor.untyped_storage().data_ptr())
            if file is not None:
                self._drop(file)

    def discard(self, tensor: Tensor) -> None:
        """Remove the file behind ``tensor`` (replaced by another): its space is freed once ``tensor`` goes."""
        file = self._files.pop(tensor.untyped_storage().data_ptr(), None)
        if file is not None:
            os.close(file.fd)
            file.path.unlink(missing_ok=True)

    def check(self, tensors: list[Tensor]) -> None:
        """Raise if a file was truncated: touching its mapped pages past the end would kill the process (SIGBUS)."""
        for tensor in tensors:
            file = self._files.get(tensor.untyped_storage().data_ptr())
            if file is not None:
                _check_size(file)

    def tensors(self) -> list[Tensor]:
        return [torch.frombuffer(f.mapped, dtype=torch.uint8) for f in self._files.values()]

    def nbytes(self) -> int:
        return sum(f.nbytes for f in self._files.values())

    def close(self) -> None:
        """Remove every file and the directory. A tensor still in use keeps its mapping, and so its data, until it
        goes (an unlinked file lives as long as it is mapped): the maps are never closed under a tensor (torch keeps
        the map object alive, not its buffer export, so an explicit close would unmap live memory)."""
        for file in self._files.values():
            os.close(file.fd)
        self._files.clear()
        self._remove_directory()
        cancel_before_exit(self._remove_directory)

    def _file(self, tensor: Tensor) -> _File:
        try:
            return self._files[tensor.untyped_storage().data_ptr()]
        except KeyError:
            raise ValueError("the tensor is not backed by a file of this store") from None

    def _pwrite(self, file: _File, source: Tensor) -> None:
        view = _bytes(source)
        done = 0
        try:
            while done < len(view):
                done += os.pwritev(file.fd, [view[done : done + _IO_CHUNK]], done)
        except OSError as err:
            raise OffloadDiskError(f"cannot write disk offload state to {file.path}: {err.strerror}") from None

    def _drop(self, file: _File) -> None:
        try:
            os.fdatasync(file.fd)
        except OSError as err:
            raise OffloadDiskError(f"cannot write disk offload state back to {file.path}: {err.strerror}") from None
        os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        file.mapped.madvise(mmap.MADV_DONTNEED)

    def _remove_directory(self) -> None:
        try:
            os.chmod(self.directory, 0o700)  # ours: if someone made it read-only, its files could not be removed
        except OSError:
            pass
        shutil.rmtree(self.directory, ignore_errors=True)


def _bytes(tensor: Tensor) -> memoryview:
    """The memory of a contiguous tensor as a writable byte view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("disk offload reads and writes contiguous tensors only")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _check_size(file: _File) -> None:
    size = os.fstat(file.fd).st_size
    if size < file.nbytes:
        raise OffloadDiskError(
            f"{file.path} was truncated to {size} bytes while disk offload uses it ({file.nbytes} bytes): something "
            "outside this run changed the offload directory"
        )
