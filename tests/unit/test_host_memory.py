"""The host budget (lightning_zero/host_memory.py): ``MemAvailable`` and the job's memory cgroup, v1 and v2, read
from faked ``/proc`` and cgroup files (the real ones are read under a memory limit in
tests/integration/test_memory_limit.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_zero.host_memory import HostMemory, host_memory

GIB = 2**30
V1_UNLIMITED = 9223372036854771712


def _proc(tmp_path: Path, mountinfo: list[str], cgroup: list[str], available_kib: int = 20 * 2**20) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {24 * 2**20} kB\nMemFree: 1 kB\nMemAvailable: {available_kib} kB\n")
    (proc / "self" / "mountinfo").write_text("\n".join(mountinfo) + "\n")
    (proc / "self" / "cgroup").write_text("\n".join(cgroup) + "\n")
    return proc


def _group(directory: Path, files: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (directory / name).write_text(f"{value}\n")
    return directory


def _v1_mounts(root: Path, mount_root: str = "/") -> list[str]:
    """A hybrid machine's mounts, as this project's: v1 controllers, and an empty v2 tree beside them."""
    return [
        f"31 23 0:28 / {root} rw,relatime - tmpfs tmpfs rw,mode=755",
        f"32 31 0:29 / {root}/cpu rw,relatime - cgroup cgroup rw,cpu",
        f"35 31 0:32 {mount_root} {root}/memory rw,relatime - cgroup cgroup rw,memory",
        f"41 31 0:38 / {root}/unified rw,relatime - cgroup2 cgroup2 rw",
    ]


def test_cgroup_v1_limit_less_usage_bounds_the_budget(tmp_path):
    root = tmp_path / "sys"
    _group(root / "memory", {"memory.limit_in_bytes": V1_UNLIMITED, "memory.usage_in_bytes": 10 * GIB})
    job = _group(root / "memory" / "memlimit.7", {
        "memory.limit_in_bytes": 3 * GIB, "memory.usage_in_bytes": GIB // 2,
        "memory.stat": f"cache 300\ninactive_file 5\ntotal_inactive_file {GIB // 4}\n",
    })
    proc = _proc(tmp_path, _v1_mounts(root), ["5:cpu:/", "4:memory:/memlimit.7", "0::/"])
    budget = host_memory(proc)
    # 3 GiB less 0.5 GiB in use, of which 0.25 GiB are inactive file pages the kernel takes back first
    assert budget == HostMemory(3 * GIB - GIB // 4, f"cgroup v1 {job}: limit 3.00 GiB less 0.25 GiB in use")
    assert budget.by_cgroup and budget.per_rank(2) == (3 * GIB - GIB // 4) // 2
    assert budget.describe(2) == f"2.75 GiB free (cgroup v1 {job}: limit 3.00 GiB less 0.25 GiB in use), shared by 2 ranks"


def test_cgroup_v2_limit_and_a_parent_limit_that_binds_first(tmp_path):
    root = tmp_path / "cgroup"
    _group(root, {"cgroup.controllers": "cpu memory"})  # the root cgroup has no memory.max
    parent = _group(root / "pod", {"memory.max": 4 * GIB, "memory.current": 3 * GIB, "memory.stat": "inactive_file 0"})
    _group(root / "pod" / "job", {"memory.max": "max", "memory.current": GIB})
    proc = _proc(tmp_path, [f"30 23 0:26 / {root} rw - cgroup2 cgroup2 rw"], ["0::/pod/job"])
    assert host_memory(proc) == HostMemory(GIB, f"cgroup v2 {parent}: limit 4.00 GiB less 3.00 GiB in use")
    # A limit looser than what the host has: MemAvailable binds.
    (parent / "memory.max").write_text(f"{40 * GIB}\n")
    assert host_memory(proc) == HostMemory(20 * GIB, "MemAvailable")


def test_inside_a_container_the_mount_root_is_the_containers_cgroup(tmp_path):
    # Docker without a cgroup namespace: /proc/self/cgroup names the host's path, which is the mount's root.
    root = tmp_path / "sys"
    job = _group(root / "memory", {"memory.limit_in_bytes": 2 * GIB, "memory.usage_in_bytes": GIB})
    proc = _proc(tmp_path, _v1_mounts(root, mount_root="/docker/abc"), ["4:memory:/docker/abc"])
    assert host_memory(proc) == HostMemory(GIB, f"cgroup v1 {job}: limit 2.00 GiB less 1.00 GiB in use")


@pytest.mark.parametrize("cgroup", [["0::/"], ["4:memory:/"], []])
def test_without_a_limit_memavailable_is_the_budget(tmp_path, cgroup):
    root = tmp_path / "sys"
    _group(root / "memory", {"memory.limit_in_bytes": V1_UNLIMITED, "memory.usage_in_bytes": GIB})
    budget = host_memory(_proc(tmp_path, _v1_mounts(root), cgroup, available_kib=2**20))
    assert budget == HostMemory(GIB, "MemAvailable") and not budget.by_cgroup


def test_no_cgroup_mounted_and_usage_above_the_limit(tmp_path):
    assert host_memory(_proc(tmp_path, [], ["0::/"])) == HostMemory(20 * GIB, "MemAvailable")
    root = tmp_path / "sys"
    job = _group(root / "memory" / "j", {"memory.limit_in_bytes": GIB, "memory.usage_in_bytes": 2 * GIB})
    budget = host_memory(_proc(tmp_path / "b", _v1_mounts(root), ["4:memory:/j"]))
    assert budget == HostMemory(0, f"cgroup v1 {job}: limit 1.00 GiB less 2.00 GiB in use")
    assert budget.per_rank(2) == 1
