"""Fork N CPU ranks sharing one gloo process group and report what became of each, including ranks that were killed,
hung or left through ``os._exit``: what each returned or raised, its exit code, its stderr, and when it ended.

``tests/harness.py`` stops at the first rank that fails; reliability tests need the survivors' side of a failure.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.harness import free_port, set_rank_environment


@dataclass
class Outcome:
    """What became of one rank."""

    rank: int
    exitcode: int | None  # None: still running when it was no longer waited for (then killed); < 0: that signal
    value: Any  # what the function returned, if it did
    error: str | None  # the traceback, if the function raised
    stderr: str
    ended: float  # time.monotonic() when the parent saw the process end (comparable across processes)

    @property
    def hung(self) -> bool:
        return self.exitcode is None


def launch(
    fn: Callable[[int, int], Any],
    world_size: int,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 120.0,
    expendable: set[int] = frozenset(),
) -> list[Outcome]:
    """``fn(rank, world_size)`` on every rank; waits until every rank not in ``expendable`` has ended (at most
    ``timeout_s``), kills the others, and reports each."""
    ctx = mp.get_context("fork")
    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, port, root, pg_timeout_s)) for r in range(world_size)
        ]
        for p in procs:
            p.start()
        ended: dict[int, float] = {}
        deadline = time.monotonic() + timeout_s
        awaited = set(range(world_size)) - set(expendable)
        while not awaited <= set(ended) and time.monotonic() < deadline:
            pending = {p.sentinel: r for r, p in enumerate(procs) if r not in ended}
            for sentinel in wait(list(pending), timeout=max(0.0, deadline - time.monotonic())):
                ended[pending[sentinel]] = time.monotonic()
        for r, p in enumerate(procs):
            if r not in ended and p.exitcode is not None:  # an expendable rank that ended meanwhile
                ended[r] = time.monotonic()
            elif r not in ended:  # hung, stopped or expendable: wake it so that SIGKILL is delivered, then reap it
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join()
        return [_outcome(root, r, procs[r].exitcode if r in ended else None, ended.get(r, float("inf")))
                for r in range(world_size)]


def _outcome(root: Path, rank: int, exitcode: int | None, ended: float) -> Outcome:
    result = root / f"{rank}.pt"
    payload = torch.load(result, weights_only=False) if result.is_file() else {}
    stderr = (root / f"{rank}.err").read_text(errors="replace") if (root / f"{rank}.err").is_file() else ""
    return Outcome(rank, exitcode, payload.get("value"), payload.get("error"), stderr, ended)


def _worker(fn, rank: int, world_size: int, port: int, root: Path, pg_timeout_s: float) -> None:
    set_rank_environment(rank, world_size, port)
    err = os.open(root / f"{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)  # what a rank prints before os._exit (or a kill) is kept
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # not pytest's capture, inherited through the fork
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
        payload = {"value": fn(rank, world_size)}
    except BaseException:
        payload = {"error": traceback.format_exc()}
        code = 1
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    (root / f"{rank}.pt.tmp").write_bytes(buffer.getvalue())
    (root / f"{rank}.pt.tmp").replace(root / f"{rank}.pt")
    os._exit(code)
