"""Disk offload (ZeRO-Infinity's idea on a filesystem): fp32 masters, optimizer states and, optionally, stage-3
parameter shards live in files, and only the sub-groups being stepped are in memory.

[Note: disk offload]
Every offloaded tensor is a file of a private directory (mode 0700, files 0600) under ``offload_dir``, created when
the strategy sets up and removed at teardown, after an error too (files.py: [Note: one file per tensor, read and
written through buffers]). Set-up writes each shard's file as soon as the shard exists and drops its pages, so it
never holds more than one shard's host copy. The step walks sub-groups of ``offload_subgroup_mb`` of parameters
through ``offload_resident_subgroups`` buffers (host arenas, staging.py; both chosen from the host budget unless
given: sizing.py, [Note: sizing disk offload's sub-groups]): a background thread reads the next
sub-groups' masters and states into their buffers (``pread``) while the current one steps in its own, and writes each
stepped sub-group back (``pwrite``, ``fdatasync``, then its pages are dropped from the page cache) while the next
ones step; the optimizer and ``ParamShard.local`` see the buffers for the duration of their sub-group's step, the
files' mapped tensors otherwise. The optimizer's states, created in memory by its first step, move into files right
after it, one sub-group at a time. Parameter shards on disk (stage 3) are read into a buffer of the largest unit's
size when their unit's all-gather is issued, and written after each step with the sub-group that updated them. So
the host memory of disk offload is its buffers, whatever the model's size, and the page cache holds none of its
files between steps: a job under a hard memory limit that counts page cache (a cgroup) trains a model whose states
do not fit in it. On a host (the training device is the CPU), the reduced gradient shards go to files too, written
as each reduction completes and read back with their sub-group (``grad_storage``), as ZeRO-Infinity swaps gradients
out with NVMe-offloaded optimizer states; and the end of fit keeps the full parameters in memory-mapped files
(``full_parameter``). Disk offload also fixes glibc's mmap threshold (memory.py: [Note: glibc's heap and a memory
limit]).

[Note: disk faults]
What can go wrong with the files once training runs, and what a rank does (tests/reliability/test_disk_faults.py):

* The disk fills up, or the directory becomes unwritable: the files that exist were preallocated and stay writable
  through their open descriptors, so nothing changes. Only the optimizer's states, created by its first step, need
  new files: creating or reserving one fails as ``OffloadDiskError`` naming the file. A write-back that fails anyway
  (``pwrite`` or ``fdatasync``: an I/O error, or a filesystem whose preallocation does not reserve, such as
  copy-on-write ones) is an ``OffloadDiskError`` naming the file too.
* The directory or files are deleted: an open file lives on until it is closed, so training goes on and the space is
  freed at teardown.
* A file is truncated: a read of it comes back short, which is an ``OffloadDiskError`` naming the file; before the
  rare accesses through its mapping (checkpoints, the end of fit) each file's size is checked, as touching a mapped
  page past the end would kill the process with SIGBUS. A truncation between that check and the access still can:
  the process dies, its peers' watchdogs name it.

Each error ends the fit on this rank; its peers fail naming it (watchdog.py); teardown removes the directory (made
writable first, as it is ours) and a checkpoint saved before the error is untouched, as it lives elsewhere.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from lightning_zero.memory import give_back_freed_memory, return_large_blocks_at_once
from lightning_zero.offload.files import FileStore, OffloadDiskError
from lightning_zero.offload.host import HostOffload
from lightning_zero.offload.sizing import SubgroupPlan
from lightning_zero.offload.staging import HostArena, Ticket, Transfers, plan_slots
from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.grad_hooks import ShardStorage
from lightning_zero.sharding.optimizer import ShardedOptimizer
from lightning_zero.sharding.sharded_param import plain_data

__all__ = ["DiskOffload", "OffloadDiskError", "private_directory"]


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


@dataclass
class _Resident:
    """One sub-group in its buffer: for each shard, the buffer views of its master, its file-backed optimizer state
    entries, its gradient shard (kept in a file on a host) and (parameters on disk) its updated rows."""

    masters: dict[ParamShard, Tensor] = field(default_factory=dict)
    states: dict[ParamShard, dict[str, tuple[Tensor, Tensor]]] = field(default_factory=dict)  # key -> (file, view)
    grads: dict[ParamShard, Tensor] = field(default_factory=dict)
    rows: dict[ParamShard, Tensor] = field(default_factory=dict)


class DiskOffload(HostOffload):
    """Optimizer offload whose masters and states (and, with ``params_on_disk``, stage-3 parameter shards) live in
    files, stepped sub-group by sub-group (see [Note: disk offload] and [Note: one offloaded step])."""

    def __init__(
        self, shards: list[ParamShard], stage: int, plan: SubgroupPlan, transfers: Transfers, directory: Path,
        grad_dtype: torch.dtype | None = None, params_on_disk: bool = False,
    ) -> None:
        return_large_blocks_at_once()  # see [Note: glibc's heap and a memory limit]
        self.store = FileStore(directory)
        #: The sub-groups' size and resident count, and why (offload/sizing.py).
        self.plan = plan
        self.resident_groups = plan.resident
        #: Bytes of the resident buffers of the last step (freed between steps): its largest sub-group's, each.
        self.step_buffer_bytes = 0
        self.params_on_disk = params_on_disk
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_zero-disk-io")
        self._reads: dict[int, Future] = {}
        self._writes: list[Future] = []
        self._groups: list[list[ParamShard]] = []
        self._optimizer: torch.optim.Optimizer | None = None
        #: During a step, one buffer per resident sub-group (sized for the largest); the unit rows' buffer.
        self._slots: list[HostArena] = []
        self._entries: list[list] = []
        self._gather_arena: HostArena | None = None
        self._gathered = Ticket.DONE
        #: The end of fit's full parameters (``full_parameter``).
        self._weights: FileStore | None = None
        self._rows: dict[ParamShard, Tensor] = {}
        self._grads: dict[ParamShard, Tensor] = {}
        #: Gradient shards kept in files (a host run: see ``grad_storage``).
        self._grad_files: list[Tensor] = []
        #: The file of each per-element optimizer state entry, by (parameter, key).
        self._state_files: dict[tuple[torch.nn.Parameter, str], Tensor] = {}
        self.shards = list(shards)
        try:
            super().__init__(shards, stage, plan.subgroup_bytes, transfers, grad_dtype)
        except BaseException:
            self.close()
            raise
        give_back_freed_memory()

    def _plan_staging(self, grad_dtype: torch.dtype | None) -> None:
        super()._plan_staging(grad_dtype)
        if self.params_on_disk and "updated rows" in self.arenas:  # the rows go to their files, not to a device
            self.arenas.pop("updated rows").close()
            self._updated_rows = {}

    def _place(self, shard: ParamShard, stage: int) -> None:
        """Into files, one shard at a time: at most one shard's host copy exists at once."""
        master_dtype = torch.float32 if shard.dtype.is_floating_point else shard.dtype
        if stage < 3:
            shard.working = shard.spec.local_view(shard.param.detach())
        elif self.params_on_disk:
            shard.working = self.store.create(shard.local, shard.dtype)
        else:
            shard.working = shard.local.to(shard.dtype, copy=True)
        shard.local = self.store.create(shard.local, master_dtype)
        shard.master_in_file = True
        if shard.sharded:
            shard.to_sharded()

    def _files_of(self, shard: ParamShard, optimizer: torch.optim.Optimizer | None = None) -> list[Tensor]:
        tensors = [shard.local] + ([shard.working] if self.params_on_disk else [])
        if optimizer is not None:
            tensors += [v for v in optimizer.state.get(shard.param, {}).values() if self.store.holds(v)]
        return [t for t in tensors if self.store.holds(t)]

    # ----------------------------------------------------------------------------------------------------- a step

    def _begin(self, sharded: ShardedOptimizer, groups: list[list[ParamShard]]) -> None:
        """Plan every sub-group's reads, allocate the resident buffers for the largest, and start reading ahead.
        What the backward freed goes back to the system first: the step's buffers are not carved from it; and the
        gradient files' pages, which the global norm may have read through their mappings, are dropped."""
        self._wait_writes()
        self.store.drop(self._grad_files)
        give_back_freed_memory()
        self._optimizer = sharded.optimizer
        self._groups = groups
        self._entries = [self._entries_of(group) for group in groups]
        nbytes = max((plan_slots([(t.shape, t.dtype) for *_, t in entries])[1] for entries in self._entries), default=0)
        self._slots = [HostArena(f"disk sub-group buffer {i}", nbytes, pinned=False) for i in range(self.resident_groups)]
        self.step_buffer_bytes = nbytes * self.resident_groups
        for index in range(min(self.resident_groups - 1, len(groups))):
            self._read_ahead(index)

    def _entries_of(self, group: list[ParamShard]) -> list[tuple[str, ParamShard, str | None, Tensor]]:
        """What a sub-group's buffer holds, as (kind, shard, state key, file tensor): its masters, the optimizer
        states already in files, the gradient shards in files (a host run), and room for the updated rows of
        parameter shards on disk."""
        entries = []
        for shard in group:
            entries.append(("master", shard, None, shard.local))
            for key, value in self._optimizer.state.get(shard.param, {}).items():
                if self.store.holds(value):
                    entries.append(("state", shard, key, value))
            grad = shard.grad_rows()
            if self.store.holds(grad):
                entries.append(("grad", shard, None, grad))
            if self.params_on_disk:
                entries.append(("rows", shard, None, shard.working))
        return entries

    def _read_ahead(self, index: int) -> None:
        """Queue the read of sub-group ``index`` into buffer ``index % resident`` (after the write-back of the
        sub-group that used that buffer before, queued earlier on the same thread)."""
        if index >= len(self._groups) or index in self._reads:
            return
        entries = self._entries[index]
        slots, _ = plan_slots([(t.shape, t.dtype) for *_, t in entries])
        arena = self._slots[index % self.resident_groups]
        self._reads[index] = self._io.submit(self._read, entries, [arena.view(slot) for slot in slots])

    def _read(self, entries: list, views: list[Tensor]) -> _Resident:
        resident = _Resident()
        for (kind, shard, key, file), view in zip(entries, views):
            if kind != "rows" and self.store.holds(file):  # rows are written, never read here; an empty shard has
                self.store.read(file, view)                   # no file
            if kind == "state":
                resident.states.setdefault(shard, {})[key] = (file, view)
            else:
                getattr(resident, {"master": "masters", "grad": "grads", "rows": "rows"}[kind])[shard] = view
        return resident

    @contextmanager
    def resident(self, index: int) -> Iterator[None]:
        """Sub-group ``index`` in its buffer while inside: masters and states swapped in; afterwards written back."""
        self._read_ahead(index)
        resident = self._reads.pop(index).result()
        self._read_ahead(index + self.resident_groups - 1)
        group = self._groups[index]
        files = {shard: shard.local for shard in group}
        for shard in group:
            shard.local = resident.masters[shard]
            for key, (_, view) in resident.states.get(shard, {}).items():
                self._optimizer.state[shard.param][key] = view
        self._rows, self._grads = resident.rows, resident.grads
        try:
            yield
        finally:
            self._rows, self._grads = {}, {}
            writes = [(files[s], resident.masters[s]) for s in group]
            writes += [(shard.working, rows) for shard, rows in resident.rows.items()]
            writes = [(file, view) for file, view in writes if self.store.holds(file)]
            for shard in group:
                shard.local = files[shard]
                writes += self._states_to_files(shard, resident.states.get(shard, {}))
            self._writes.append(self._io.submit(self._write_back, writes))

    def _states_to_files(self, shard: ParamShard, swapped_in: dict[str, tuple[Tensor, Tensor]]) -> list:
        """Point ``shard``'s per-element optimizer states back at their files; returns the (file, buffer) writes of
        those stepped in a buffer. A state the step created (the first step), or a checkpoint load put in memory,
        goes into its file now."""
        writes = []
        state = self._optimizer.state.get(shard.param, {})
        for key, value in list(state.items()):
            file, view = swapped_in.get(key, (None, None))
            if value is view:
                writes.append((file, value))
                state[key] = file
            elif torch.is_tensor(value) and value.dim() > 0 and value.numel() and not self.store.holds(value):
                file = self._state_files.get((shard.param, key))
                if file is None or file.shape != value.shape or file.dtype != value.dtype:
                    file = self.store.create(value)
                else:
                    self.store.write(file, value.contiguous())
                    self.store.drop([file])
                state[key] = file
            if self.store.holds(state[key]):
                replaced = self._state_files.get((shard.param, key))
                if replaced is not None and replaced is not state[key]:  # a checkpoint load gave it a new file
                    self.store.discard(replaced)
                self._state_files[(shard.param, key)] = state[key]
        return writes

    def _write_back(self, writes: list[tuple[Tensor, Tensor]]) -> None:
        for file, view in writes:
            self.store.write(file, view)
        self.store.drop([file for file, _ in writes])

    def _end(self) -> None:
        """Wait for the write-backs and free the sub-group buffers until the next step (on a host the backward's
        gathers and reductions then use that memory)."""
        self._wait_writes()
        self._reads.clear()
        for arena in self._slots:
            arena.close()
        self._slots, self._entries = [], []
        give_back_freed_memory()  # the buffers, and the states a first step created in memory, now in files

    def _wait_writes(self) -> None:
        writes, self._writes = self._writes, []
        for write in writes:
            write.result()

    def _host_grad(self, shard: ParamShard) -> Tensor:
        """A gradient shard kept in a file was read into the sub-group's buffer with its master."""
        grad = self._grads.get(shard)
        return grad.float() if grad is not None else super()._host_grad(shard)

    def grad_storage(self) -> ShardStorage | None:
        """Gradient shards in files where they would otherwise take host memory: a run whose training device is the
        host (on CUDA they stay on the device, which disk offload does not relieve)."""
        return None if self.transfers.stages else _GradFiles(self)

    def push(self, group) -> Ticket:
        """Parameter shards on disk: the updated rows go into the sub-group's buffer, written back with it (outside
        a step, after a checkpoint load, through the files' mappings)."""
        if not self.params_on_disk:
            return super().push(group)
        for shard in group:
            rows = self._rows.get(shard)
            (rows if rows is not None else shard.working).copy_(shard.local)
            shard.mark_written()
        return Ticket.DONE

    def refresh(self) -> None:
        super().refresh()
        self.release_pages()

    def release_pages(self) -> None:
        """Flush and drop the pages of every file (after a checkpoint read or wrote them through their mappings)."""
        optimizers = [self._optimizer] if self._optimizer is not None else []
        self.store.drop(self.disk_tensors(optimizers))
        give_back_freed_memory()

    def write_master(self, shard: ParamShard, rows: Tensor) -> None:
        """Load ``rows`` into ``shard``'s master file (``pwrite``, then dropped): nothing of a resume's masters stays
        in memory."""
        if self.store.holds(shard.local):
            self.store.write(shard.local, rows.to("cpu", torch.float32 if rows.is_floating_point() else rows.dtype)
                             .contiguous())
            self.store.drop([shard.local])

    def keep_state_rows(self, rows: Tensor) -> Tensor:
        """This rank's rows of a loaded optimizer state go straight into a file of their own (the step then keeps
        them there): a resume holds one state tensor in memory at a time, not all of them."""
        return self.store.create(rows)

    def full_parameter(self, tensor: Tensor, device: torch.device) -> Tensor:
        """With parameter shards on disk, the model does not fit in host memory, so the end of fit keeps each full
        parameter in a file of its own, memory-mapped (pages come in as they are read), whose pages are dropped once
        written: the module is whole, as under DDP, at the cost of no memory. The files are in a directory of their
        own under ``offload_dir``, removed at teardown; their mappings keep the data until the tensors go."""
        if not self.params_on_disk or device.type != "cpu":
            return super().full_parameter(tensor, device)
        if self._weights is None:  # a directory of its own: the training one may be gone (see [Note: disk faults])
            base = self.store.directory.parent
            try:
                self._weights = FileStore(Path(tempfile.mkdtemp(prefix="lightning_zero-weights-", dir=base)))
            except OSError as err:
                raise OffloadDiskError(f"cannot keep the trained weights under offload_dir={str(base)!r}: "
                                       f"{err.strerror}") from None
        return self._weights.create(tensor)

    def check_files(self) -> None:
        """Before a rare access through the mappings: every file still has its size (else SIGBUS)."""
        optimizers = [self._optimizer] if self._optimizer is not None else []
        self.store.check(self.disk_tensors(optimizers))

    @contextmanager
    def staged(self, shards: list[ParamShard]) -> Iterator[list[Tensor] | None]:
        """Parameter shards on disk are read into the unit buffer for their unit's all-gather to pack; the buffer is
        written again only after that pack's copy ran."""
        if not self.params_on_disk:
            with super().staged(shards) as sources:
                yield sources
            return
        self._gathered.wait()
        slots, nbytes = plan_slots([(s.working.shape, s.working.dtype) for s in shards])
        if self._gather_arena is None or self._gather_arena.nbytes < nbytes:
            if self._gather_arena is not None:
                self._gather_arena.close()
            self._gather_arena = HostArena("disk unit rows", nbytes, pinned=self.transfers.pinned)
        views = [self._gather_arena.view(slot) for slot in slots]
        for shard, view in zip(shards, views):
            if self.store.holds(shard.working):
                self.store.read(shard.working, view)
            else:  # an empty shard (more ranks than rows) has no file
                view.copy_(shard.working)
        yield views
        self._gathered = self.transfers.record()

    def host_buffers(self) -> list[Tensor]:
        arenas = [a for a in (*self._slots, self._gather_arena) if a is not None]
        return super().host_buffers() + [a.storage() for a in arenas]

    def disk_tensors(self, optimizers: list[torch.optim.Optimizer]) -> list[Tensor]:
        """Every file-backed tensor (placement accounting: these bytes are on disk)."""
        states = [v for o in optimizers for st in o.state.values() for v in st.values() if self.store.holds(v)]
        return [t for s in self.shards for t in self._files_of(s)] + states + self._grad_files

    def close(self, optimizers: tuple[torch.optim.Optimizer, ...] = ()) -> None:
        """Remove the files. The masters become views of the full parameters if the module holds them (end of fit),
        else empty. Optimizer states kept in the files stay readable through their mappings (an unlinked file lives
        as long as it is mapped, its pages on disk, not in memory), so that a checkpoint saved after fit holds them,
        as under DDP; their disk space returns when the optimizer goes."""
        self._io.shutdown(wait=True)
        for shard in self.shards:
            full = plain_data(shard.param)
            shard.local = shard.spec.local_view(full) if full.shape == shard.spec.shape else torch.empty(0)
            if self.params_on_disk:
                shard.working = None
        self.store.close()
        if self._weights is not None:
            self._weights.close()
        for arena in (*self._slots, self._gather_arena):
            if arena is not None:
                arena.close()
        if hasattr(self, "arenas"):
            super().close()


class _GradFiles(ShardStorage):
    """Gradient shards in files of the offload's store: each reduction's rows are written (or added to what the file
    holds, under gradient accumulation) with ``pwrite``, and the file is flushed and dropped from the page cache on
    the I/O thread, so that the gradients of a backward never accumulate in memory."""

    def __init__(self, offload: DiskOffload) -> None:
        self.offload = offload

    def make(self, shard: ParamShard, like: Tensor) -> Tensor:
        file = self.offload.store.reserve(like.shape, like.dtype)
        if self.offload.store.holds(file):
            self.offload._grad_files.append(file)
        return file

    def put(self, destination: Tensor, rows: Tensor, accumulate: bool) -> None:
        store = self.offload.store
        if not store.holds(destination):  # an empty shard
            return
        if accumulate:
            held = torch.empty_like(rows)
            store.read(destination, held)
            rows = held.add_(rows)
        store.write(destination, rows.contiguous())
        self.offload._writes.append(self.offload._io.submit(store.drop, [destination]))
