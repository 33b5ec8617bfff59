"""Run a function on N forked CPU ranks that share one gloo process group, and collect what each returns.

One call = one fork of N processes, which then run as many sub-cases as the function likes: a Lightning fit in an
already-initialized process group costs well under a second, a fresh spawn several seconds. The environment
variables Lightning reads (``LOCAL_RANK``, ``WORLD_SIZE``, ...) are set, so a ``Trainer`` built inside a rank sees
an externally launched job and joins the existing process group instead of launching its own.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ranks(fn: Callable[[int, int], Any], world_size: int, timeout_s: float = TIMEOUT_S) -> list[Any]:
    """``fn(rank, world_size)`` on every rank; returns the results in rank order or raises with a rank's traceback."""
    ctx = mp.get_context("fork")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    errors: list[str] = []
    try:
        waited = 0.0
        while len(collected) + len(errors) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or waited > timeout_s:
                    raise AssertionError(f"ranks died or hung (exit codes {[p.exitcode for p in procs]})") from None
                continue
            if ok:
                collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [collected[r] for r in range(world_size)]


def set_rank_environment(rank: int, world_size: int, port: int) -> None:
    """The variables a launcher sets for one rank on one node, which Lightning reads to join the job."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
    )


def _worker(fn, rank: int, world_size: int, port: int, results) -> None:
    set_rank_environment(rank, world_size, port)
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        # Tensors go through torch.save: torch's default queue pickling shares them by file descriptor, which dies
        # with the rank.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        code = 1
    finally:
        results.close()
        results.join_thread()
        os._exit(code)
