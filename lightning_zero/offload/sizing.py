"""How large disk offload's sub-groups are and how many it keeps in host memory, when the options do not say.

[Note: sizing disk offload's sub-groups]
Disk offload holds ``resident`` sub-group buffers, each of a sub-group's fp32 masters and what is read and written
with them (two Adam moments, the parameter rows with parameter shards on disk, the gradient shards where a host run
keeps them in files): ``per_master_byte`` bytes per byte of master. That is the one part of its host memory that
does not follow from the model: the defaults of earlier releases, 3 x 256 MiB, held up to 3.75 GiB per rank, sized
for a big host where a job that needs disk offload runs on a small one. So with neither option given:

* the buffers take at most ``BUFFER_SHARE`` of the rank's host budget (host_memory.py: the smaller of
  ``MemAvailable`` and the job's cgroup limit less its usage, shared by the node's ranks, read at set-up when the
  states are about to move into files, so what they free counts too); the rest of the budget is for what every
  stage-3 rank holds besides (the process, gathered units and reductions in flight, activations);
* a sub-group is never smaller than ``MIN_SUBGROUP_MB``, where the step stops paying for its sub-group count:
  measured on a 50M GPT of 2 MiB shards (benchmarks/offload_subgroups.py, BENCHMARKS.md "Disk offload's sub-group
  size"), the offloaded step took 1.09-1.18x the best wall time with sub-groups of 1-4 MiB (25 to 50 of them), 1.00-
  1.02x with 8 and 16 MiB; larger ones gained nothing and cost up to 1.2x the CPU time (their buffers, allocated
  afresh each step, are faulted in again);
* two buffers (one stepping, one the I/O thread writes back and reads the next sub-group into: reads and writes
  run on one thread, so a third only lets it run further ahead: no faster in the same measurement), three when the
  budget holds three of the largest;
* never more than ``MAX_SUBGROUP_MB``, nor more than the rank's masters spread over its buffers.

An option given wins, each on its own; without a host budget (``lightning-zero estimate`` asked for no placement)
the big-host sizes stand. The plan (``SubgroupPlan``) says what it chose and why; the run report prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_zero.config import OffloadConfig

MIB = 2**20
#: The smallest sub-group chosen from a budget (see [Note: sizing disk offload's sub-groups]).
MIN_SUBGROUP_MB = 8.0
#: The largest, and the resident count, of a host with room: the sizes of earlier releases.
MAX_SUBGROUP_MB = 256.0
MAX_RESIDENT = 3
MIN_RESIDENT = 2
#: The share of a rank's host budget that the resident sub-groups may take.
BUFFER_SHARE = 0.25


@dataclass(frozen=True)
class SubgroupPlan:
    """Disk offload's sub-group size in bytes of fp32 masters and its resident count, and what set them."""

    subgroup_bytes: int
    resident: int
    reason: str

    def buffer_bytes(self, per_master_byte: float, masters_bytes: int | None = None) -> int:
        """Host memory of the resident buffers (at most the ``masters_bytes`` the rank has, when given)."""
        held = self.resident * self.subgroup_bytes
        if masters_bytes is not None:
            held = min(held, masters_bytes)
        return int(held * per_master_byte)

    def describe(self) -> str:
        return f"{self.resident} resident sub-groups of {self.subgroup_bytes / MIB:.1f} MiB of masters ({self.reason})"


def per_master_byte(rows_bytes: int, grad_bytes: int) -> float:
    """Bytes a sub-group's buffer holds per byte of fp32 master: the master and two fp32 moments, ``rows_bytes`` of
    parameter row per element (parameter shards on disk; else 0) and ``grad_bytes`` of gradient (shards a host run
    keeps in files; else 0)."""
    return (12 + rows_bytes + grad_bytes) / 4


def plan_subgroups(
    offload: OffloadConfig, masters_bytes: int, per_master_byte: float, host_budget: int | None,
    largest_master: int = 0,
) -> SubgroupPlan:
    """The sizes for a rank holding ``masters_bytes`` of fp32 masters (the largest shard's ``largest_master``: a
    sub-group holds whole shards, so it can pass its size by up to one) with ``host_budget`` bytes of host memory
    (None: unknown); see [Note: sizing disk offload's sub-groups]."""
    given_size, given_resident = offload.offload_subgroup_mb, offload.offload_resident_subgroups
    if given_size is not None and given_resident is not None:
        return SubgroupPlan(offload.subgroup_bytes, given_resident, "given")
    if host_budget is None:
        resident = given_resident or MAX_RESIDENT
        size = offload.subgroup_bytes if given_size is not None else int(MAX_SUBGROUP_MB * MIB)
        return SubgroupPlan(size, resident, "no host budget known: the sizes for a big host")
    share = int(BUFFER_SHARE * host_budget)
    largest = int((MAX_SUBGROUP_MB * MIB + largest_master) * per_master_byte)
    resident = given_resident or (MAX_RESIDENT if MAX_RESIDENT * largest <= share else MIN_RESIDENT)
    if given_size is not None:
        size = offload.subgroup_bytes
    else:
        fitting = share / (resident * per_master_byte) - largest_master
        spread = -(-masters_bytes // resident)
        size = int(max(MIN_SUBGROUP_MB * MIB, min(fitting, MAX_SUBGROUP_MB * MIB, spread)))
    return SubgroupPlan(size, resident, f"from {BUFFER_SHARE:.0%} of a host budget of {host_budget / 2**30:.2f} GiB "
                                        "per rank")
