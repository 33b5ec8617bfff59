"""The host memory offload moves data through, and the one owner of copies between host and device.

[Note: copies between host and device]
Every copy offload makes between the training device and host memory goes through ``Transfers``, and every one of
them hands back a ``Ticket``: the event recorded after it. A consumer waits on the ticket of exactly what it reads,
and a buffer is written again only after the ticket of its last copy, so no ordering rests on a stream having been
waited on as a whole, or on a copy having "surely" finished:

* device to host (gradient shards before the host step) runs on a side stream, after an event recorded on the
  compute stream once the gradients exist; the host waits for the ticket of each group before stepping it, so the
  copies of later groups overlap the step of earlier ones;
* host to device (the updated rows after each group's step) runs on the side stream too; the compute stream waits on
  the tickets before the gathers read the rows;
* a unit's all-gather that packs rows kept on the host (``offload_params``) copies them on the compute stream as part
  of the pack, and its ticket guards those host rows: the next step's update writes them only after it.

Without a CUDA device the same calls run: the copies are plain (synchronous) ones and every ticket is complete, so a
CPU run executes the pipeline, its placement and its arithmetic exactly as a GPU run does.

[Note: host arenas]
Host memory offload keeps for moving data (gradient staging, updated rows, disk offload's sub-group buffers) is one
allocation per purpose (``HostArena``), sized from the plan when the offload is set up, carved into views and reused
every step, and counted in ``model_state_bytes()`` as ``buffers``. Where a CUDA device exists it is page-locked by
registering it with CUDA (``cudaHostRegister``), at its size in whole pages: torch's caching host allocator, behind
``pin_memory=True``, rounds every request up to a power of two and keeps freed blocks for the rest of the process,
which would hold up to twice the pinned memory offload needs, and keep set-up's transient buffers locked for the whole
run. Views start on 4 KiB boundaries (what direct I/O and DMA want).

CUDA locks whole pages, and refuses to register a range that overlaps one registered already. The heap places small
allocations side by side, so two small arenas registered as allocated (from their first byte to their last) would
share a page, and the second registration would fail. So an arena allocates a page more than its pages
(``allocation_bytes``) and registers only the whole pages inside its allocation, from the first page boundary on
(``locked_range``): no other allocation has a byte in them.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: Views of an arena start at multiples of this many bytes.
ALIGNMENT = 4096


#: What ``cudaHostRegister`` locks whole: the host's page (see [Note: host arenas]).
PAGE = max(ALIGNMENT, mmap.PAGESIZE)


def aligned(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


def allocation_bytes(nbytes: int, page: int = PAGE) -> int:
    """What an arena of ``nbytes`` allocates: its whole pages, and one more so that they can start on a page boundary
    wherever the allocator put them."""
    return aligned(nbytes, page) + page if nbytes else 0


def locked_range(address: int, nbytes: int, page: int = PAGE) -> tuple[int, int]:
    """Where an arena of ``nbytes`` starts in its allocation (``allocation_bytes``) at ``address``, and how many
    bytes from there it page-locks: whole pages covering the arena, every one inside the allocation."""
    return (-address) % page, aligned(nbytes, page)


@dataclass(frozen=True)
class Slot:
    """Where one tensor sits in an arena: byte offset, shape and dtype."""

    offset: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_slots(tensors: Sequence[tuple[torch.Size, torch.dtype]]) -> tuple[list[Slot], int]:
    """Consecutive aligned slots for tensors of these shapes and dtypes, and the bytes they need in all."""
    slots, offset = [], 0
    for shape, dtype in tensors:
        slot = Slot(offset, torch.Size(shape), dtype)
        slots.append(slot)
        offset += aligned(slot.nbytes)
    return slots, offset


class HostArena:
    """One allocation of host memory for one purpose (see [Note: host arenas]), page-locked where ``pinned``."""

    def __init__(self, purpose: str, nbytes: int, pinned: bool) -> None:
        self.purpose = purpose
        self.pinned = pinned and nbytes > 0
        self._memory = torch.empty(allocation_bytes(nbytes), dtype=torch.uint8)
        self._start, self._locked = locked_range(self._memory.data_ptr(), nbytes)
        self.nbytes = nbytes
        if self.pinned:
            _register(self._memory.data_ptr() + self._start, self._locked)

    def view(self, slot: Slot) -> Tensor:
        """The tensor at ``slot`` (a view of the arena: writing it writes the arena)."""
        if slot.offset + slot.nbytes > self.nbytes:
            raise ValueError(f"{self.purpose}: a slot of {slot.nbytes} bytes at {slot.offset} passes the arena's "
                             f"{self.nbytes} bytes")
        start = self._start + slot.offset
        return self._memory[start : start + slot.nbytes].view(slot.dtype).view(slot.shape)

    def storage(self) -> Tensor:
        """The whole allocation, for memory accounting."""
        return self._memory

    def close(self) -> None:
        if self.pinned:
            _unregister(self._memory.data_ptr() + self._start)
            self.pinned = False
        self._memory = torch.empty(0, dtype=torch.uint8)
        self.nbytes = 0


def _register(address: int, nbytes: int) -> None:
    error = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1))  # portable
    if error != 0:
        raise RuntimeError(f"page-locking {nbytes} bytes of host memory for offload failed (CUDA error {error})")


def _unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


class Ticket:
    """The event recorded after a batch of copies (``None``: complete already, as every copy is without CUDA)."""

    DONE: Ticket

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self._event = event

    def wait(self) -> None:
        """The host waits until the copies are complete (before it reads or rewrites their host side)."""
        if self._event is not None:
            self._event.synchronize()

    def wait_on_stream(self, stream: torch.cuda.Stream) -> None:
        """``stream``'s later work waits for the copies (before a kernel on it reads their device side)."""
        if self._event is not None:
            stream.wait_event(self._event)


Ticket.DONE = Ticket()


class Transfers:
    """The one owner of copies between host and ``device`` (see [Note: copies between host and device])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    @property
    def stages(self) -> bool:
        """Whether copies cross between host and device memory, so that host-side data is staged in host arenas
        (without a CUDA device the host *is* the device: nothing to stage)."""
        return self.cuda

    @property
    def pinned(self) -> bool:
        """Whether host buffers that copies read or write should be page-locked."""
        return self.cuda

    def compute_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def copy(self, pairs: Sequence[tuple[Tensor, Tensor]]) -> Ticket:
        """``dst.copy_(src)`` for every ``(dst, src)`` pair, on the side stream after the work queued so far on the
        compute stream (which produced the sources); the ticket is recorded after the last copy."""
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return Ticket.DONE
        produced = torch.cuda.Event()
        produced.record(self.compute_stream())
        self.stream.wait_event(produced)
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                for tensor in (dst, src):
                    if tensor.device.type == "cuda":
                        tensor.record_stream(self.stream)  # not reused by the allocator before the copy ran
            done = torch.cuda.Event()
            done.record(self.stream)
        return Ticket(done)

    def record(self) -> Ticket:
        """A ticket for the work queued so far on the compute stream (copies issued there, as a gather's pack)."""
        if not self.cuda:
            return Ticket.DONE
        event = torch.cuda.Event()
        event.record(self.compute_stream())
        return Ticket(event)

    def wait_on_compute(self, tickets: Sequence[Ticket]) -> None:
        """The compute stream's later work waits for these copies."""
        stream = self.compute_stream()
        for ticket in tickets:
            if stream is not None:
                ticket.wait_on_stream(stream)
