"""Disk offload (ZeRO-Infinity's idea on a filesystem): fp32 masters, optimizer states and, optionally, stage-3
parameter shards live in files, and only the sub-groups being stepped are in memory.

[Note: disk offload]
Every offloaded tensor is a memory map of its own file (``MappedStore``) in a private directory (mode 0700, files
0600) under ``offload_dir``, created when the strategy sets up and removed at teardown, after an error too. The files
are preallocated (``posix_fallocate``), so a full disk is one clear error before training starts, never a failed
write (a SIGBUS) in the middle of it. Because they are ordinary tensors, everything that reads or writes model state
(the optimizer, checkpoints, ``load_state_dict``, consolidation) works on them unchanged, page by page; what disk
offload adds is *when* pages are in memory. The step walks sub-groups of ``offload_subgroup_mb``: a background
thread reads the next sub-groups' pages while the current one steps, and a stepped sub-group is written back and its
pages released (``msync``, then ``MADV_DONTNEED`` and ``POSIX_FADV_DONTNEED``), so at most
``offload_resident_subgroups`` sub-groups are resident. The optimizer's states, created in memory by its first
step, move into files right after it. Parameter shards on disk (stage 3) are read ahead when their unit's all-gather
is issued and released once it is packed.

[Note: disk faults]
What can go wrong with the files once training runs, and what a rank does (tests/reliability/test_disk_faults.py):

* The disk fills up, or the directory becomes unwritable: the files that exist were preallocated and stay writable
  through their open descriptors and mappings, so nothing changes. Only the optimizer's states, created by its
  first step, need new files: creating or reserving one fails as ``OffloadDiskError`` naming the file. A write-back
  that fails anyway (``msync``: an I/O error, or a filesystem whose preallocation does not reserve, such as
  copy-on-write ones) is an ``OffloadDiskError`` naming the file too.
* The directory or files are deleted: an open, mapped file lives on until it is closed, so training goes on and the
  space is freed at teardown.
* A file is truncated: touching a mapped page past its end would kill the process with SIGBUS, so before its pages are
  read (``prefetch``) each file's size is checked, and a short one is an ``OffloadDiskError`` naming it. A truncation
  between that check and the step can still raise SIGBUS: the process dies, its peers' watchdogs name it.

Each error ends the fit on this rank; its peers fail naming it (watchdog.py); teardown removes the directory (made
writable first, as it is ours) and a checkpoint saved before the error is untouched, as it lives elsewhere.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from lightning_zero.offload.host import HostOffload
from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.optimizer import ShardedOptimizer
from lightning_zero.watchdog import cancel_before_exit, run_before_exit

_PAGE = mmap.PAGESIZE


class OffloadDiskError(RuntimeError):
    """The offload directory is missing, not writable or too small; the message names it."""


def private_directory(base: str | None, rank: int, needed_bytes: int, ranks_sharing: int = 1) -> Path:
    """A new private directory under ``base`` (default: the system's temporary directory) for this rank's files,
    after checking that ``base`` exists, is writable and has room for every rank of this node."""
    where = Path(base) if base is not None else Path(tempfile.gettempdir())
    if not where.is_dir():
        raise OffloadDiskError(f"offload_dir={str(where)!r} does not exist or is not a directory")
    if not os.access(where, os.W_OK | os.X_OK):
        raise OffloadDiskError(f"offload_dir={str(where)!r} is not writable")
    free = shutil.disk_usage(where).free
    if needed_bytes * ranks_sharing > free:
        raise OffloadDiskError(
            f"offload_dir={str(where)!r} has {free / 2**30:.2f} GiB free, disk offload needs about "
            f"{needed_bytes * ranks_sharing / 2**30:.2f} GiB ({ranks_sharing} rank(s) of this node, "
            f"{needed_bytes / 2**30:.2f} GiB each)"
        )
    try:
        return Path(tempfile.mkdtemp(prefix=f"lightning_zero-rank{rank}-", dir=where))
    except OSError as err:
        raise OffloadDiskError(f"offload_dir={str(where)!r} is not writable: {err.strerror}") from None


class MappedStore:
    """Tensors backed by preallocated, memory-mapped files in one private directory (see [Note: disk offload])."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._maps: dict[int, tuple[mmap.mmap, int, Path]] = {}  # storage pointer -> (map, fd, file)
        self._count = 0
        run_before_exit(self._remove_directory)  # a rank the watchdog ends leaves no files behind either

    def tensor_like(self, tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """A new file-backed tensor holding a copy of ``tensor`` (cast to ``dtype``)."""
        dtype = dtype or tensor.dtype
        numel = tensor.numel()
        if numel == 0:
            return torch.empty(tensor.shape, dtype=dtype)
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
        out = torch.frombuffer(mapped, dtype=dtype, count=numel).view(tensor.shape)
        out.copy_(tensor)
        self._maps[out.untyped_storage().data_ptr()] = (mapped, fd, path)
        return out

    def holds(self, tensor: Tensor) -> bool:
        return torch.is_tensor(tensor) and tensor.untyped_storage().data_ptr() in self._maps

    def prefetch(self, tensors: list[Tensor]) -> None:
        """Bring the pages of ``tensors`` into memory (runs in the read-ahead thread)."""
        for tensor in tensors:
            entry = self._maps.get(tensor.untyped_storage().data_ptr())
            if entry is not None:
                _check_size(*entry)
                entry[0].madvise(mmap.MADV_WILLNEED)
                flat = tensor.view(-1).view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor.view(-1)
                flat[:: max(1, _PAGE // tensor.dtype.itemsize)].sum()  # touch one element per page

    def release(self, tensors: list[Tensor]) -> None:
        """Write ``tensors``' pages back to their files and drop them from memory."""
        for tensor in tensors:
            entry = self._maps.get(tensor.untyped_storage().data_ptr())
            if entry is not None:
                mapped, fd, path = entry
                try:
                    mapped.flush()
                except OSError as err:
                    raise OffloadDiskError(f"cannot write disk offload state back to {path}: {err.strerror}") from None
                mapped.madvise(mmap.MADV_DONTNEED)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def nbytes(self) -> int:
        return sum(len(m) for m, _, _ in self._maps.values())

    def close(self) -> None:
        """Remove every file and the directory (the tensors must not be used afterwards)."""
        for mapped, fd, _ in self._maps.values():
            try:
                mapped.close()
            except BufferError:  # a tensor still exports the buffer: the mapping goes with the process
                pass
            os.close(fd)
        self._maps.clear()
        self._remove_directory()
        cancel_before_exit(self._remove_directory)

    def _remove_directory(self) -> None:
        try:
            os.chmod(self.directory, 0o700)  # ours: if someone made it read-only, its files could not be removed
        except OSError:
            pass
        shutil.rmtree(self.directory, ignore_errors=True)


def give_back_freed_memory() -> None:
    """Return the heap pages freed by moving tensors into files to the system (glibc's ``malloc_trim``).

    Tensors of a few MiB come from glibc's heap once its mmap threshold has grown (it does after the first large
    free), and the heap keeps freed pages: without this, the host copies that set-up and the first step move into files
    would stay resident, and disk offload would lower a rank's peak RSS by about nothing (benchmarks/offload_rss.py
    measured 3% lower against 52% with it). A no-op where the C library has no ``malloc_trim``.
    """
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _check_size(mapped: mmap.mmap, fd: int, path: Path) -> None:
    """A file shorter than its mapping would raise SIGBUS when touched (see [Note: disk faults])."""
    size = os.fstat(fd).st_size
    if size < len(mapped):
        raise OffloadDiskError(
            f"{path} was truncated to {size} bytes while disk offload uses it ({len(mapped)} bytes): something outside "
            "this run changed the offload directory"
        )


class DiskOffload(HostOffload):
    """Optimizer offload whose masters and states (and, with ``params_on_disk``, stage-3 parameter shards) live in
    files, stepped sub-group by sub-group (see [Note: disk offload] and [Note: one offloaded step])."""

    def __init__(
        self, shards: list[ParamShard], stage: int, group_bytes: int, directory: Path, resident: int,
        params_on_disk: bool = False,
    ) -> None:
        self.store = MappedStore(directory)
        self.resident_groups = resident
        self.params_on_disk = params_on_disk
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_zero-disk-read")
        self._ahead: dict[int, Future] = {}
        self._groups: list[list[ParamShard]] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self.shards = list(shards)
        try:
            super().__init__(shards, stage, group_bytes, params_on_host=params_on_disk)
            self.store.release([t for s in self.shards for t in self._files_of(s)])
        except BaseException:
            self.close()
            raise
        give_back_freed_memory()

    def _move_to_host(self, shard: ParamShard, stage: int, params_on_host: bool) -> None:
        """Into files, one shard at a time: the host copies of one shard at most exist at once."""
        super()._move_to_host(shard, stage, params_on_host)
        shard.local = self.store.tensor_like(shard.local)
        if self.params_on_disk:
            shard.working = self.store.tensor_like(shard.working)
            if shard.sharded:
                shard.to_sharded()

    def _files_of(self, shard: ParamShard, optimizer: torch.optim.Optimizer | None = None) -> list[Tensor]:
        tensors = [shard.local] + ([shard.working] if self.params_on_disk else [])
        if optimizer is not None:
            tensors += [v for v in optimizer.state.get(shard.param, {}).values() if self.store.holds(v)]
        return tensors

    # ----------------------------------------------------------------------------------------------------- a step

    def _begin(self, sharded: ShardedOptimizer, groups: list[list[ParamShard]]) -> None:
        self._optimizer = sharded.optimizer
        self._groups = groups
        self._ahead.clear()
        for index in range(min(self.resident_groups - 1, len(groups))):
            self._read_ahead(index)

    def _read_ahead(self, index: int) -> None:
        if index < len(self._groups) and index not in self._ahead:
            tensors = [t for s in self._groups[index] for t in self._files_of(s, self._optimizer)]
            self._ahead[index] = self._reader.submit(self.store.prefetch, tensors)

    @contextmanager
    def resident(self, index: int) -> Iterator[None]:
        """Wait for group ``index``'s pages, read the next groups ahead; afterwards write it back and release it."""
        self._read_ahead(index)
        self._ahead.pop(index).result()
        self._read_ahead(index + self.resident_groups - 1)
        try:
            yield
        finally:
            self._after_step(self._groups[index])

    @contextmanager
    def staged(self, shards: list[ParamShard]) -> Iterator[None]:
        """Parameter shards on disk are paged in for their unit's all-gather and released once it is packed."""
        if not self.params_on_disk:
            yield
            return
        working = [s.working for s in shards]
        self.store.prefetch(working)
        try:
            yield
        finally:
            self.store.release(working)

    def _after_step(self, group: list[ParamShard]) -> None:
        """Move states the optimizer just created into files, then write the sub-group back and release it."""
        moved = False
        with torch.no_grad():
            for shard in group:
                state = self._optimizer.state.get(shard.param, {})
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0 and not self.store.holds(value):
                        state[key] = self.store.tensor_like(value)
                        moved = True
        self.store.release([t for s in group for t in self._files_of(s, self._optimizer)])
        if moved:
            give_back_freed_memory()

    def push(self, group: list[ParamShard]) -> None:
        super().push(group)
        if self.params_on_disk:
            self.store.release([s.working for s in group])

    def disk_tensors(self, optimizers: list[torch.optim.Optimizer]) -> list[Tensor]:
        """Every file-backed tensor (placement accounting: these bytes are on disk)."""
        states = [v for o in optimizers for st in o.state.values() for v in st.values() if self.store.holds(v)]
        return [t for s in self.shards for t in self._files_of(s)] + states

    def close(self, optimizers: tuple[torch.optim.Optimizer, ...] = ()) -> None:
        """Remove the files. The masters become views of the full parameters if the module holds them (end of fit),
        else empty; optimizer states kept in the files are dropped (checkpoints that need them are saved during
        fit)."""
        self._reader.shutdown(wait=True)
        for optimizer in optimizers:
            for param in [p for p, st in optimizer.state.items() if any(self.store.holds(v) for v in st.values())]:
                del optimizer.state[param]
        for shard in self.shards:
            full = shard.param.detach()
            shard.local = shard.spec.local_view(full) if full.shape == shard.spec.shape else torch.empty(0)
            if self.params_on_disk:
                shard.working = None
        self.store.close()
