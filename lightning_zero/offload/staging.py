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
registering that one allocation with CUDA (``cudaHostRegister``), at its exact size: torch's caching host allocator,
behind ``pin_memory=True``, rounds every request up to a power of two and keeps freed blocks for the rest of the
process, which would hold up to twice the pinned memory offload needs, and keep set-up's transient buffers locked for
the whole run. Views start on 4 KiB boundaries (pages: what direct I/O and DMA want).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: Views of an arena start at multiples of this many bytes.
ALIGNMENT = 4096


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


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
        # One byte more than a page so that the first view can start on a page boundary, whatever the allocator gave.
        self._memory = torch.empty(nbytes + ALIGNMENT if nbytes else 0, dtype=torch.uint8)
        self._start = (-self._memory.data_ptr()) % ALIGNMENT if nbytes else 0
        self.nbytes = nbytes
        if self.pinned:
            _register(self._memory)

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
            _unregister(self._memory)
            self.pinned = False
        self._memory = torch.empty(0, dtype=torch.uint8)
        self.nbytes = 0


def _register(memory: Tensor) -> None:
    error = int(torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel(), 1))  # portable
    if error != 0:
        raise RuntimeError(f"page-locking {memory.numel()} bytes of host memory for offload failed (CUDA error {error})")


def _unregister(memory: Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(memory.data_ptr())


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
