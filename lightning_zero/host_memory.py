"""How much host memory a job may still take: the kernel's ``MemAvailable``, and, where the job runs in a memory
cgroup (a container, a Kubernetes pod, a SLURM job with memory enforcement, ``../shared/tools/memlimit``), that
cgroup's limit less what it already uses.

[Note: the host budget]
``MemAvailable`` is the host's figure: the kernel kills a job at its cgroup's limit long before the host runs out. So
the budget is the smallest of ``MemAvailable`` and, for the job's own cgroup and each one above it (a limit set on a
parent binds its children too), the limit less the usage: cgroup v2's ``memory.max`` and ``memory.current``, v1's
``memory.limit_in_bytes`` and ``memory.usage_in_bytes``, the job's cgroup read from ``/proc/self/cgroup`` and found
where ``/proc/self/mountinfo`` says its hierarchy is mounted (inside a container the mount's root is the container's
cgroup). The usage counts page cache, and the kernel takes back the inactive file pages (``inactive_file`` of
``memory.stat``, ``total_inactive_file`` on v1) before it kills anything, so they count as free, as they do in
``MemAvailable`` (and in Kubernetes' working set). A machine with both hierarchies mounted (v1's memory controller
and an empty v2 tree, as this project's machine) is read where the memory controller is. The budget is the job's,
shared by the ranks of the node (``HostMemory.per_rank``): read before the ranks start, what they will hold is not in
use yet; read inside a rank, the others' usage already is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: A v1 limit at or above this is "no limit" (the kernel's own value is 2^63 rounded down to a page).
_UNLIMITED = 1 << 60
_PROC = Path("/proc")


@dataclass(frozen=True)
class HostMemory:
    """Bytes the job may still take on this host (``available``), and what bounds them (``source``: ``"MemAvailable"``
    or the cgroup whose limit does, with its limit and usage)."""

    available: int
    source: str

    @property
    def by_cgroup(self) -> bool:
        return self.source != "MemAvailable"

    def per_rank(self, ranks: int) -> int:
        """Each of ``ranks`` ranks' share (at least one byte)."""
        return max(1, self.available // max(1, ranks))

    def describe(self, ranks: int = 1) -> str:
        shared = f", shared by {ranks} ranks" if ranks > 1 else ""
        return f"{_gib(self.available)} GiB free ({self.source}){shared}"


@dataclass(frozen=True)
class _Cgroup:
    """One memory cgroup's directory and the names of its files (v1 or v2)."""

    directory: Path
    version: int

    def headroom(self) -> tuple[int, str] | None:
        """The limit less the usage that cannot be reclaimed at once, and a description; None without a limit."""
        names = ("memory.max", "memory.current", "inactive_file") if self.version == 2 else (
            "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        limit = _read_number(self.directory / names[0])
        usage = _read_number(self.directory / names[1])
        if limit is None or limit >= _UNLIMITED or usage is None:
            return None
        reclaimable = _stat(self.directory / "memory.stat").get(names[2], 0)
        used = max(0, usage - reclaimable)
        where = f"cgroup v{self.version} {self.directory}"
        return max(0, limit - used), f"{where}: limit {_gib(limit)} GiB less {_gib(used)} GiB in use"


def host_memory(proc: Path = _PROC) -> HostMemory:
    """What the job may still take on this host (see [Note: the host budget]); ``proc`` is ``/proc`` (tests fake
    it)."""
    best = HostMemory(mem_available(proc), "MemAvailable")
    for cgroup in _own_cgroups(proc):
        headroom = cgroup.headroom()
        if headroom is not None and headroom[0] < best.available:
            best = HostMemory(*headroom)
    return best


def mem_available(proc: Path = _PROC) -> int:
    """Memory the kernel can give without swapping (``MemAvailable``), else the free physical pages."""
    for line in _lines(proc / "meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _own_cgroups(proc: Path) -> list[_Cgroup]:
    """The job's memory cgroup and each one above it up to its hierarchy's mount (none outside a cgroup)."""
    mount = _memory_mount(proc)
    if mount is None:
        return []
    mount_point, mount_root, version = mount
    path = _cgroup_path(proc, version)
    if path is None:
        return []
    relative = Path(path).relative_to(mount_root) if Path(path).is_relative_to(mount_root) else Path(path.lstrip("/"))
    directory = mount_point / relative
    chain = [directory, *(p for p in directory.parents if p.is_relative_to(mount_point))]
    return [_Cgroup(d, version) for d in chain if d.is_dir()]


def _memory_mount(proc: Path) -> tuple[Path, str, int] | None:
    """Where the memory controller's hierarchy is mounted: (mount point, the cgroup at its root, version); v1's
    memory controller first, as a hybrid machine's v2 tree holds no controller."""
    v2 = None
    for line in _lines(proc / "self" / "mountinfo"):
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        fstype, options = fields[dash + 1], fields[dash + 3].split(",") if len(fields) > dash + 3 else []
        root, point = _unescape(fields[3]), Path(_unescape(fields[4]))
        if fstype == "cgroup" and "memory" in options:
            return point, root, 1
        if fstype == "cgroup2" and v2 is None:
            v2 = (point, root, 2)
    return v2


def _cgroup_path(proc: Path, version: int) -> str | None:
    """This process's cgroup in the memory hierarchy (``/proc/self/cgroup``: ``ID:controllers:path``)."""
    for line in _lines(proc / "self" / "cgroup"):
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers = parts[1].split(",")
        if (version == 1 and "memory" in controllers) or (version == 2 and parts[0] == "0" and parts[1] == ""):
            return parts[2]
    return None


def _read_number(path: Path) -> int | None:
    """An integer file of a cgroup; ``max`` (v2's no limit) and a missing file are None."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path) -> dict[str, int]:
    entries = (line.split() for line in _lines(path))
    return {e[0]: int(e[1]) for e in entries if len(e) == 2 and e[1].isdigit()}


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline and backslash in a path as octal escapes."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"
