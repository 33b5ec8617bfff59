"""Every tensor alive in this process, counted as a user meets it: what the garbage collector finds, not only what a
strategy reports (tests/distributed/test_zero3_memory.py, test_held_after_step.py, benchmarks/held_after_step.py)."""

from __future__ import annotations

import gc
import time

import torch

#: Counts taken, a pause apart: the least is what the process holds (see ``live_tensor_bytes``).
SETTLE_COUNTS, SETTLE_PAUSE_S = 3, 0.05


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable in this process (each storage once), the least of a few counts a
    moment apart: a collective's work object keeps its tensors (and their Python objects) alive until the process
    group's worker thread lets go of it, which on a loaded machine can be a moment after ``wait()`` has returned. What
    a strategy really keeps is in every count."""
    counts = []
    for i in range(SETTLE_COUNTS):
        if i:
            time.sleep(SETTLE_PAUSE_S)
        counts.append(_count())
    return min(counts)


def _count() -> int:
    gc.collect()
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total
