"""Lean or fast memory: whether a rank holds exactly what the ZeRO formulas say between steps, or keeps buffers
and its allocator's free memory for the step time they save.

[Note: lean or fast memory]
Three choices trade a rank's memory for CPU time, each measured on its own (memory.py, in_flight.py, replicated.py):

* glibc's heap, on a CPU device under stage 3 or an optimizer offload: the mmap threshold fixed at 1 MiB, every
  block of a step's activations and gathers is mapped afresh and handed back at once (peak -19% on the 85M GPT); left
  to glibc, freed blocks stay in its heap and are reused (step -19%), and fixed at 32 MiB with the heap's top never
  cut back, they are reused without page faults (step -4.5% more on M-2: [Note: glibc's heap and a memory limit]);
* stage 3's bucket buffers: handed back at the end of each step (a rank holds 16Ψ/N between steps) or kept from step
  to step (two units' buffers: 0.22 of 16Ψ/N on a 4-layer GPT-2);
* stages 1 and 2's all-gathers after the update: completed before the step returns where their buffers would be a
  large share of the parameters, or left in flight to overlap the next forward (1.06x against 1.19x Lightning DDP's
  step on M-2: [Note: what the gathers in flight hold]).

The lean side of each is what a model that barely fits needs; the fast side is what every other run wants. So
``lean_memory=None`` (the default) chooses by the budget: lean where this rank's model states (the formula of
memory_model.py for its stage, offload and precision) exceed ``LEAN_SHARE`` of the memory they live in (on a CPU
device the host budget per rank of host_memory.py, a container's limit included; on CUDA the device's memory), the
smallest budget over the ranks so that every rank decides alike (stages 1 and 2 issue their gathers in an order that
depends on it); lean always under disk offload, chosen to fit a model in less host memory. What the fast side holds
beyond the formulas was measured at up to 0.4x them after a step (zero1's gathers in flight on M-2) and peaks 23-43%
higher (glibc's heap: the 85M and 303M GPTs), so below an eighth of the budget it fits with room for the
activations. ``lean_memory=True`` or ``False`` decides for every run. Explicit ``overlap_gather`` and
``buffer_pool_mb`` still decide their own part.

On M-2 (10.6M parameters, 2 CPU ranks) the fast side took zero3 from 1.14x to 0.84x Lightning FSDP2's step, zero1
and zero2 from 1.06-1.11x to 0.99-1.00x Lightning DDP's (docs/benchmarks/lightning.md).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lightning_zero.config import ZeroConfig
from lightning_zero.estimate_options import option_name
from lightning_zero.host_memory import host_memory
from lightning_zero.memory import keep_freed_blocks, return_large_blocks_at_once
from lightning_zero.memory_model import estimate
from lightning_zero.sharding.collectives import Collectives

#: Model states above this share of their budget make a run lean (see [Note: lean or fast memory]).
LEAN_SHARE = 1 / 8


def model_state_share(config: ZeroConfig, module: nn.Module, ranks: int, precision: str, budget: int) -> float:
    """This rank's model states under ``config`` (the memory model's formula) as a share of ``budget`` bytes."""
    params = list(module.parameters())
    num_params = sum(p.numel() for p in params)
    if num_params == 0:
        return 0.0
    trainable = sum(p.numel() for p in params if p.requires_grad)
    offload = config.offload
    option = option_name(config.stage, offload.offload_optimizer, offload.offload_params)
    states = estimate(option, num_params, ranks, precision, trainable_params=trainable).model_states
    return states / budget


def memory_budget(device: torch.device, local_ranks: int) -> int:
    """The memory this rank's model states live in: its share of the host budget on a CPU device, the device's
    memory on CUDA."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory().per_rank(local_ranks)


def lean_config(config: ZeroConfig, module: nn.Module, comms: Collectives, precision: str,
                local_ranks: int) -> ZeroConfig:
    """``config`` with ``lean_memory`` decided (see [Note: lean or fast memory]); a lean run on a CPU device under
    stage 3 or an optimizer offload fixes glibc's mmap threshold from here until teardown, its setup included."""
    lean = resolve_lean(config, module, comms, precision, local_ranks)
    if lean and _sets_glibc_heap(config, comms):
        return_large_blocks_at_once()  # see [Note: glibc's heap and a memory limit] in memory.py
    return dataclasses.replace(config, lean_memory=lean)


def before_steps(config: ZeroConfig, comms: Collectives) -> None:
    """Once setup is done and has given its freed memory back: a fast run (``config`` from ``lean_config``) on a CPU
    device under stage 3 or an optimizer offload keeps glibc's heap until teardown ([Note: glibc's heap and a memory
    limit] in memory.py). Not during setup, which builds a model one module at a time and keeps each one's rows: with
    the heap kept there its peak rose from under a shard and three layers to 1.4x that (tests/distributed/
    test_large_init.py)."""
    if config.lean_memory is False and _sets_glibc_heap(config, comms):
        keep_freed_blocks()


def _sets_glibc_heap(config: ZeroConfig, comms: Collectives) -> bool:
    return comms.device.type == "cpu" and (config.stage == 3 or bool(config.offload.offload_optimizer))


def describe(lean: bool, config: ZeroConfig) -> str:
    """What the run report says of the choice: which side, and why."""
    side = "lean (what ZeRO's formulas say)" if lean else "fast (buffers and freed memory kept for speed)"
    if config.lean_memory is not None:
        return f"{side}: lean_memory={config.lean_memory}"
    if config.offload.on_disk:
        return f"{side}: disk offload"
    over = "over" if lean else "at most"
    return f"{side}: the model states are {over} 1/{round(1 / LEAN_SHARE)} of the memory budget"


def resolve_lean(config: ZeroConfig, module: nn.Module, comms: Collectives, precision: str, local_ranks: int) -> bool:
    """``lean_memory`` where given, else decided alike on every rank from the largest share of its budget that a
    rank's model states take; always lean under disk offload."""
    if config.lean_memory is not None:
        return config.lean_memory
    if config.offload.on_disk:
        return True
    budget = memory_budget(comms.device, local_ranks)
    share = model_state_share(config, module, comms.world_size, precision, budget)
    largest = torch.tensor([share], dtype=torch.float64, device=comms.device)
    comms.world.all_reduce_(largest, "the model states' share of each rank's memory budget", op="max")
    return largest.item() > LEAN_SHARE
