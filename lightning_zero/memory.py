"""The host memory a rank holds: counting the model-state bytes from the tensors themselves, and giving freed memory
back to the system.

Parameters, gradients and optimizer states are counted by storage, so a tensor and the views of it (a stage-1/2 shard
is a view of its full parameter) are counted once, at the size of the storage actually allocated.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.sharding.sharded_grad import held_rows
from lightning_zero.sharding.sharded_param import is_sharded


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of one rank's model states by kind (wherever they live), how many of them live on the host and on disk
    rather than on the training device, and the buffers kept between uses to move them (bucket pools, offload's
    staging and I/O buffers), which are not model state but are held all the same (``buffers``, of which
    ``buffers_host`` on the host)."""

    params: int
    grads: int
    optimizer: int
    host: int = 0
    disk: int = 0
    buffers: int = 0
    buffers_host: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> int:
        """Bytes on the training device (the CPU itself in a CPU run, where placement is still accounted)."""
        return self.total - self.host - self.disk

    @property
    def held(self) -> int:
        """Everything counted: the model states and the kept buffers."""
        return self.total + self.buffers


def model_state_bytes(
    module: nn.Module,
    optimizers: Iterable[Optimizer] = (),
    extra_params: Iterable[torch.Tensor] = (),
    extra_grads: Iterable[torch.Tensor] = (),
    extra_optimizer: Iterable[torch.Tensor] = (),
    host: Iterable[torch.Tensor] = (),
    disk: Iterable[torch.Tensor] = (),
    buffers: Iterable[torch.Tensor] = (),
    host_buffers: Iterable[torch.Tensor] = (),
) -> ModelStateBytes:
    """Bytes of the parameters of ``module``, their gradients and the ``optimizers``' states.

    The ``extra_*`` tensors are model state held outside the module and the optimizers' ``state`` (a sharding
    strategy's standalone parameter shards, gradient shard storage, fp32 master copies, which count as optimizer
    state as in the ZeRO paper's accounting). ``host`` and ``disk`` name the counted tensors that live on the host
    and in files (offload); ``buffers`` and ``host_buffers`` are the kept buffers on the training device and on the
    host, counted apart.
    """
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
    # a stage-3 parameter between its uses holds a one-element placeholder, not model state
    params = [p for p in module.parameters() if not is_sharded(p)] + list(extra_params)
    grads = [held_rows(p.grad) for p in module.parameters() if p.grad is not None] + list(extra_grads)
    states = list(extra_optimizer) + [v for o in optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
    seen: set[tuple[torch.device, int]] = set()
    optimizer = _storage_bytes(states, seen)  # first: a stage-3 parameter between uses holds its fp32 master
    params_bytes, grads_bytes = _storage_bytes(params, seen), _storage_bytes(grads, seen)
    host_buffers_bytes = _storage_bytes(host_buffers, set())
    return ModelStateBytes(
        params_bytes, grads_bytes, optimizer, host=_storage_bytes(host, set()), disk=_storage_bytes(disk, set()),
        buffers=_storage_bytes(buffers, set()) + host_buffers_bytes, buffers_host=host_buffers_bytes,
    )


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[torch.device, int]]) -> int:
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def give_back_freed_memory() -> None:
    """Return the heap pages freed since the last call to the system (glibc's ``malloc_trim``).

    glibc serves tensors of a few MiB from its heap once its mmap threshold has grown (it does after the first large
    free, up to 32 MiB), and the heap keeps freed pages: the full parameters set-up frees as their shards are cut,
    and the host copies disk offload moves into files, would otherwise stay resident, and count in the process's peak
    as if they were still held. Called where a rank has just freed much at once (after set-up, after disk offload's
    first step); a no-op where the C library has no ``malloc_trim``.
    """
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


#: glibc's ``mallopt`` parameters (malloc.h): the mmap and trim thresholds, by name.
_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1
_NAMES = {_M_MMAP_THRESHOLD: "M_MMAP_THRESHOLD", _M_TRIM_THRESHOLD: "M_TRIM_THRESHOLD"}
#: Both thresholds' value when glibc starts, unless the environment sets them (mallopt(3)).
_GLIBC_DEFAULT = 128 << 10
#: The mmap threshold of a lean run (and of disk offload).
LARGE_BLOCK_BYTES = 1 << 20
#: The mmap threshold of a fast run: the ceiling glibc raises its own threshold to (64-bit), as large blocks are freed.
HEAP_BLOCK_BYTES = 32 << 20
#: The trim threshold of a fast run: the largest ``mallopt`` takes (an ``int``), so the heap's top is never cut back.
_NEVER_TRIM = 2**31 - 1


def return_large_blocks_at_once() -> bool:
    """Make glibc serve every allocation of at least ``LARGE_BLOCK_BYTES`` with its own mapping, handed back to the
    system as soon as it is freed (``mallopt(M_MMAP_THRESHOLD, 1 MiB)``, which also stops glibc from raising the
    threshold as it otherwise does after each large free, up to 32 MiB).

    [Note: glibc's heap and a memory limit]
    With the threshold moving, the activations, gathered parameters and gradients of a few MiB that a step allocates
    and frees come from glibc's heap, which keeps freed pages for reuse; fragmentation leaves much of them unused yet
    resident. On the 303M-parameter GPT of BENCHMARKS.md under disk offload that was 0.4 GiB per rank of the training
    peak (1.24 GiB against 0.87 with the threshold fixed), memory a hard limit counts like any other; on the 85M GPT
    of BENCHMARKS.md's per-phase table, in-memory zero3 on the CPU peaked at 1.57 GiB per rank in its steady steps,
    1.39 with the threshold fixed (the formula: 1.31). The cost is that such blocks are mapped afresh each time (page
    faults): well under 1% of a disk-offloaded step, whose reads and writes dominate, but measurable where a step
    allocates and frees activations of a few MiB many times: that zero3 step took 2.97 s against 2.40 (+24%; peak 1.28
    GiB against 1.58 in that run), 2.75 s with the threshold at 8 MiB (peak 1.33), 2.43 s at 24 MiB (peak 1.42), where
    only the buckets and gathered units are mapped. Disk offload, chosen to fit a model in less host memory, fixes
    the threshold at 1 MiB when it sets up, and so does ZeroStrategy's setup wherever the training device is the CPU
    under stage 3 or an optimizer offload and the run holds lean, its model states a large share of the host budget
    ([Note: lean or fast memory] in memory_policy.py): such runs hold what the formulas say, for that cost
    (process-wide, until ZeroStrategy's teardown; zero1 and zero2 without offload keep glibc's default, as DDP runs
    with it; on a GPU the model's memory is the device's and nothing changes).

    Left to glibc, a fast run (not lean) still gave pages back: glibc cuts its heap's top back to the system whenever
    more than its trim threshold (twice the moving mmap threshold) is free there, as at the end of every backward,
    and the next step faults those pages in again. On M-2 (10.6M GPT, 2 CPU ranks) zero3 took 1-11 thousand minor
    page faults a step a rank that way; so a fast run on a CPU device under stage 3 or an optimizer offload, once its
    setup is done, fixes the mmap threshold at ``HEAP_BLOCK_BYTES`` (where glibc's own would end up) and stops the
    trimming (``keep_freed_blocks``, from memory_policy.before_steps): no page faults in the steady steps, 310 ->
    296 ms a step (0.76x -> 0.73x Lightning FSDP2's, which the same setting leaves unchanged), training peak 252.4
    -> 254.9 MB. The heap then holds the largest step's memory until teardown, as a fast run's buffers are held.
    Both return whether the C library has ``mallopt``.

    The settings are the process's, not the run's: ZeroStrategy's teardown gives them back the values glibc started
    with (``restore_glibc_heap``), and the run report names them while they hold (``glibc_heap_settings``). glibc
    has no getter for them, so the values restored are those it documents (128 KiB each) or the ones the
    environment gave it (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``). What cannot be
    restored is glibc's moving threshold: any ``mallopt`` of either threshold fixes both for good, so after a run the
    mmap threshold stays at its starting value instead of rising with large frees.
    """
    return _mallopt((_M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES))


def keep_freed_blocks() -> bool:
    """Make glibc keep what a step frees for the next step: blocks under ``HEAP_BLOCK_BYTES`` come from its heap,
    whose top is never cut back (see [Note: glibc's heap and a memory limit])."""
    return _mallopt((_M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES), (_M_TRIM_THRESHOLD, _NEVER_TRIM))


def _mallopt(*settings: tuple[int, int]) -> bool:
    """``mallopt(param, value)`` for each setting, process-wide; whether the C library has it and took them all."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    took = [bool(mallopt(param, value)) for param, value in settings]  # every one set, whatever an earlier returned
    _made.update((param, value) for (param, value), ok in zip(settings, took) if ok)
    return all(took)


#: The ``mallopt`` settings this process made and has not restored, by parameter: the latest value of each.
_made: dict[int, int] = {}


def glibc_heap_settings() -> dict[str, int]:
    """The ``mallopt`` settings in effect that this library made (see [Note: glibc's heap and a memory limit]), by
    name, until ``restore_glibc_heap``."""
    return {_NAMES[param]: value for param, value in _made.items()}


def restore_glibc_heap() -> None:
    """Give every ``mallopt`` setting this library made the value glibc started the process with (see [Note: glibc's
    heap and a memory limit])."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is not None:
        for param in _made:
            mallopt(param, _started_with(param))
    _made.clear()


def _started_with(param: int) -> int:
    """The value of ``param`` glibc started with: the environment's where it gave one, else glibc's default."""
    name = _NAMES[param].removeprefix("M_").lower()
    tunables = dict(item.partition("=")[::2] for item in os.environ.get("GLIBC_TUNABLES", "").split(":"))
    given = tunables.get(f"glibc.malloc.{name}") or os.environ.get(f"MALLOC_{name.upper()}_")
    try:
        return int(given, 0) if given else _GLIBC_DEFAULT
    except ValueError:  # glibc ignores a value it cannot read, too
        return _GLIBC_DEFAULT


_MADV_DONTNEED = 4  # unmap these pages from this process (a file mapping's: read again from the file if touched)
_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now, page cache included, where the kernel can
_PAGE = mmap.PAGESIZE


class MappedPages:
    """Drops the pages under views of a memory-mapped checkpoint whose rows were just copied out (``release``): they
    leave the resident set instead of staying mapped until the whole checkpoint is dropped (``madvise``:
    ``MADV_PAGEOUT``, which also reclaims them from the page cache where the kernel can, then ``MADV_DONTNEED``, which
    unmaps whatever is left). Only a file's pages, and only for a mapping never written to (a checkpoint as loaded):
    a later read gets the file's bytes again; a tensor in anonymous memory (a state dict built in memory) is left
    alone. The file mappings are read from ``/proc/self/maps`` once, when made: make one per load, while the loaded
    tensors keep their mappings alive. A no-op off the CPU or where ``madvise`` is missing."""

    def __init__(self) -> None:
        self._madvise = getattr(_libc(), "madvise", None)
        self._files = _file_mappings() if self._madvise is not None else []

    def release(self, tensor: torch.Tensor) -> None:
        if self._madvise is None or tensor.device.type != "cpu" or tensor.numel() == 0:
            return
        storage = tensor.untyped_storage()
        if not any(start <= storage.data_ptr() < end for start, end in self._files):
            return
        if tensor.is_contiguous():
            start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        else:  # its bytes are not one range: the whole storage
            start, nbytes = storage.data_ptr(), storage.nbytes()
        first = start - start % _PAGE
        for advice in (_MADV_PAGEOUT, _MADV_DONTNEED):
            self._madvise(ctypes.c_void_p(first), ctypes.c_size_t(start + nbytes - first), advice)


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of files (``/proc/self/maps``: a non-zero inode)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, _perms, _offset, _dev, inode = line.split(maxsplit=5)[:5]
                if inode != "0":
                    start, end = (int(x, 16) for x in span.split("-"))
                    ranges.append((start, end))
    except OSError:
        pass
    return ranges


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None
