"""Disk offload's sub-group sizes chosen from the host budget and the model (lightning_zero/offload/sizing.py); the
run's choice, reported, is checked under a memory limit in tests/integration/test_memory_limit.py."""

from __future__ import annotations

import pytest

from lightning_zero.config import OffloadConfig
from lightning_zero.offload.sizing import SubgroupPlan, per_master_byte, plan_subgroups

MIB, GIB = 2**20, 2**30
DISK = OffloadConfig(offload_optimizer="disk", offload_params="disk")
#: fp32 on a host: master, two moments, parameter rows and gradient shards in files, 20 bytes per 4 of master.
PER_BYTE = per_master_byte(4, 4)


def test_bytes_per_byte_of_master():
    assert PER_BYTE == 5.0
    assert per_master_byte(0, 0) == 3.0  # the master and the moments only (stage 1, parameters in memory)
    assert per_master_byte(2, 2) == 4.0  # 16-bit rows and gradients


@pytest.mark.parametrize(
    ("budget", "masters", "largest", "expected"),
    [
        # A quarter of 1 GiB is 256 MiB: 2 buffers of 5 bytes per byte of master, less the largest shard a sub-group
        # may run past its size by: 256 / 10 - 8 = 17.6 MiB.
        (GIB, 2 * GIB, 8 * MIB, (int(17.6 * MIB), 2)),
        # Too little for even the smallest efficient sub-group: 8 MiB all the same.
        (100 * MIB, 2 * GIB, 8 * MIB, (8 * MIB, 2)),
        # A big host: three of the largest (3 x 256 MiB x 5 = 3.75 GiB) fit in a quarter of 64 GiB.
        (64 * GIB, 10 * GIB, 8 * MIB, (256 * MIB, 3)),
        # No more than the rank's masters spread over its buffers: 300 MiB over 3.
        (64 * GIB, 300 * MIB, 0, (100 * MIB, 3)),
        # A small model: never below the floor, however few masters.
        (64 * GIB, 4 * MIB, 0, (8 * MIB, 3)),
    ],
)
def test_sizes_from_the_budget_and_the_model(budget, masters, largest, expected):
    plan = plan_subgroups(DISK, masters, PER_BYTE, budget, largest)
    assert (plan.subgroup_bytes, plan.resident) == expected
    assert plan.reason == f"from 25% of a host budget of {budget / GIB:.2f} GiB per rank"
    if expected[1] == 2 and expected[0] > 8 * MIB:
        assert plan.buffer_bytes(PER_BYTE) + 2 * largest * PER_BYTE <= budget / 4


def test_an_option_given_wins_each_on_its_own():
    given = OffloadConfig(offload_optimizer="disk", offload_subgroup_mb=16.0, offload_resident_subgroups=4)
    assert plan_subgroups(given, 2 * GIB, PER_BYTE, 100 * MIB) == SubgroupPlan(16 * MIB, 4, "given")
    size_given = OffloadConfig(offload_optimizer="disk", offload_subgroup_mb=1.0)
    assert (plan_subgroups(size_given, 2 * GIB, PER_BYTE, 64 * GIB).resident,
            plan_subgroups(size_given, 2 * GIB, PER_BYTE, GIB).subgroup_bytes) == (3, MIB)
    resident_given = OffloadConfig(offload_optimizer="disk", offload_resident_subgroups=4)
    plan = plan_subgroups(resident_given, 2 * GIB, PER_BYTE, GIB)
    assert (plan.subgroup_bytes, plan.resident) == (int(12.8 * MIB), 4)  # 256 MiB / (4 x 5)


def test_without_a_budget_the_sizes_of_a_big_host():
    plan = plan_subgroups(DISK, 2 * GIB, PER_BYTE, None)
    assert plan == SubgroupPlan(256 * MIB, 3, "no host budget known: the sizes for a big host")
    assert plan.buffer_bytes(PER_BYTE) == 3 * 256 * MIB * 5
    assert plan.buffer_bytes(PER_BYTE, masters_bytes=100 * MIB) == 500 * MIB  # never more than all of them
    assert plan.describe() == ("3 resident sub-groups of 256.0 MiB of masters (no host budget known: the sizes for a "
                               "big host)")
