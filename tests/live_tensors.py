"""Every tensor alive in this process, counted as a user meets it: what the garbage collector finds, not only what a
strategy reports (tests/distributed/test_zero3_memory.py, test_held_after_step.py, benchmarks/held_after_step.py)."""

from __future__ import annotations

import gc

import torch


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable in this process (each storage once)."""
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
