"""Run a command, and every process it starts, under one memory limit: a cgroup of its own (v2, or v1's memory
controller), as a host with that much RAM would hold the job. Page cache counts and is reclaimed under pressure; the
kernel kills the job when it cannot stay under the limit. Needs root and a writable cgroup hierarchy.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

_V2 = Path("/sys/fs/cgroup")
_V1 = Path("/sys/fs/cgroup/memory")


@dataclass(frozen=True)
class LimitedRun:
    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int
    oom_killed: bool


def available() -> str | None:
    """Why a limited run is impossible here, or ``None`` if it is possible."""
    if os.geteuid() != 0:
        return "memory limits need root (a cgroup of their own)"
    if (_V2 / "cgroup.controllers").is_file():
        if "memory" not in (_V2 / "cgroup.subtree_control").read_text().split():
            return "the cgroup v2 memory controller is not enabled for child groups"
        return None
    if (_V1 / "memory.limit_in_bytes").is_file() and os.access(_V1, os.W_OK):
        return None
    return "no writable cgroup memory controller"


def run_limited(limit_bytes: int, argv: list[str], timeout_s: float, env: dict | None = None) -> LimitedRun:
    """Run ``argv`` in a new cgroup limited to ``limit_bytes`` (no swap); returns its outcome and peak usage."""
    v2 = (_V2 / "cgroup.controllers").is_file()
    group = (_V2 if v2 else _V1) / f"lightning_zero-test-{uuid.uuid4().hex[:12]}"
    group.mkdir()
    try:
        if v2:
            (group / "memory.max").write_text(str(limit_bytes))
            (group / "memory.swap.max").write_text("0")
        else:
            (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        procs = group / "cgroup.procs"
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, env=env,
            preexec_fn=lambda: procs.write_text(str(os.getpid())),  # the child joins before it runs anything
        )
        peak = int((group / ("memory.peak" if v2 else "memory.max_usage_in_bytes")).read_text())
        if v2:
            events = dict(line.split() for line in (group / "memory.events").read_text().splitlines())
            killed = int(events.get("oom_kill", 0)) > 0
        else:
            control = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
            killed = int(control.get("oom_kill", 0)) > 0
        return LimitedRun(result.returncode, result.stdout, result.stderr, peak, killed)
    finally:
        _remove(group)


def _remove(group: Path) -> None:
    """Remove the cgroup once its processes are gone (a killed job's last process may take a moment)."""
    import time

    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
