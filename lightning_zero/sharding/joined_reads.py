"""Reads of sharded values that every rank must join, and the check that makes a read run by one rank fail on that
rank within moments instead of hanging every rank.

[Note: a read that runs on one rank]
Under DDP ``p.grad`` and ``p`` are local tensors, so code that runs on one rank only is ordinary:
``if trainer.is_global_zero: log(p.grad.norm())``, a ``@rank_zero_only`` callback reading ``p.grad.abs().max()``.
Here a gradient, and a stage-3 parameter between its uses, are each rank's rows (sharded_grad.py), and a reduction
over all of them needs the other ranks' partial results: a collective. Issued by one rank, it is matched by no peer;
the peers go on and issue their next collective, which the reading rank never matches, and every rank waits for the
process group's timeout (30 minutes), alive, so the watchdog (which looks for dead peers) cannot end it.

So reads are of two kinds. What DDP code commonly computes on one rank is answered there with no collective: every
gradient's L2 norm and largest magnitude are taken once each time the gradients become complete, by every rank
together (``UserView.complete``), and ``p.grad.norm()``, ``clip_grad_norm_``, Lightning's ``grad_norm`` and
``p.grad.abs().max()`` read them. Every other read that needs a collective first *joins*: this module. The rank
publishes in the process group's store which read it is about to issue and at which point of its run, then waits
until every rank of the group has published the same read at the same point, and only then issues the collective.

The point of a run is its count of issued collectives: the sum of c10d's own sequence numbers over every process
group this process belongs to, plus zero3's unit-order announcements on a shared-memory board
(``issued_collectives``). Every rank issues the same collectives in the same order (see [Note: how the order of
collectives is owned] in collectives.py), so ranks that reach the same read have the same count, and a rank whose
count is already past it has issued a collective there instead of the read: it went on without it. Each rank's
watchdog publishes its count in the store at every heartbeat (``Watchdog.progress``: read from c10d by the
watchdog's thread, so it is published even while the training thread is blocked in a collective), and a waiting
reader reads its peers'. No thread and no store connection of its own: a connection cloned per setup for a responder
thread made the store slow to answer (5 s a setup in a 4-rank job) and, in a test with a 2 s failure timeout,
unanswered for over 2 s. So:

* every rank runs the read: they all publish it, and the collective runs as before (the cost: a store round trip
  or two per read, for reads that are not norms);
* a rank runs it alone: a peer's published count passes it at the peer's first heartbeat after its next
  collective (``heartbeat_s``, 2 s by default), and the reader raises :class:`OneRankReadError` naming the call,
  the rank that went on, and the supported ways; the error goes through Lightning's ``on_exception``, the watchdog
  publishes it, and the peers, blocked in a collective the reader will never issue, end with an error naming the
  reading rank (watchdog.py);
* two ranks run different reads at the same point: the first to see it raises, naming both.

A peer that stays behind without issuing anything (a long computation of its own, or a wait this count does not see:
a store-based barrier) is waited for, up to the strategy's ``timeout``, and so is every peer where the watchdog is off
(``failure_timeout_s=None``: no count is published); a peer that died is the watchdog's to report.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed import default_pg_timeout

from lightning_zero.sharding.unit_order import SharedBoard

if TYPE_CHECKING:
    from lightning_zero.watchdog import Watchdog

#: The longest sleep between two looks at the peers' announcements.
MAX_SLEEP_S = 0.05
#: One namespace per ``JoinedReads`` made in this process: every rank makes them in the same order (one per setup).
_GENERATIONS = itertools.count()


class OneRankReadError(RuntimeError):
    """A read of sharded values that needs every rank ran on some ranks only (see [Note: a read that runs on one
    rank])."""


def issued_collectives() -> int:
    """How far this process is: the collectives it issued on every process group it belongs to (c10d's sequence
    numbers), and zero3's unit collectives announced on a shared-memory board (unit_order.py)."""
    world = dist.distributed_c10d._world
    issued = sum(group._get_sequence_number_for_group() for group in list(world.pg_map))
    return issued + SharedBoard.announced_in_process


class JoinedReads:
    """Reads every rank of a group must join (see [Note: a read that runs on one rank]). ``progress_key``: where a
    rank's watchdog publishes its count of issued collectives (``None``: no watchdog); ``timeout_s``: how long a peer
    that neither joined nor went on is waited for."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float,
                 progress_key: Callable[[int], str] | None = None,
                 progress: Callable[[], int] = issued_collectives) -> None:
        self.rank, self.world_size = rank, world_size
        self.progress, self.progress_key, self.timeout_s = progress, progress_key, timeout_s
        self._prefix = f"lightning_zero/reads/{next(_GENERATIONS)}/"
        self._store = store  # the process group's own client, which c10d also uses from the training thread

    @classmethod
    def open(cls, timeout: timedelta | None, watchdog: Watchdog | None) -> JoinedReads | None:
        """Over the default process group's store; ``None`` with one rank. ``timeout``: the process group's
        (``None``: torch's default); ``watchdog``: the one publishing every rank's count, made to publish it."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        if watchdog is not None:
            watchdog.progress = issued_collectives
        timeout_s = (timeout or default_pg_timeout).total_seconds()
        store = dist.distributed_c10d._get_default_store()
        reads = cls(store, dist.get_rank(), dist.get_world_size(), timeout_s,
                    watchdog.progress_key if watchdog is not None else None)
        store.set(reads._read_key(reads.rank), "")  # no read yet: once every rank has opened, every key exists
        return reads

    def join(self, what: str, way_out: str, ranks: Sequence[int] | None = None) -> None:
        """Wait until every rank of ``ranks`` (global ranks; default: all) is about to run the read ``what`` at this
        point, or raise :class:`OneRankReadError` (naming ``way_out``) once one of them is seen past it."""
        point = self.progress()
        self._store.set(self._read_key(self.rank), f"{point}\t{what}")
        peers = [r for r in (range(self.world_size) if ranks is None else ranks) if r != self.rank]
        started, sleep = time.monotonic(), 0.0
        while waiting := self._not_joined(peers, point, what, way_out):
            self._check_progress(waiting, point, what, way_out)
            if time.monotonic() - started > self.timeout_s:
                raise OneRankReadError(
                    f"{what} on rank {self.rank}: rank(s) {waiting} neither ran it nor went on within "
                    f"{self.timeout_s:g} s (the strategy's timeout). {way_out}")
            sleep = min(MAX_SLEEP_S, sleep * 2 or 1e-4)
            time.sleep(sleep)

    def _not_joined(self, peers: list[int], point: int, what: str, way_out: str) -> list[int]:
        """The peers that have not announced the read ``what`` at ``point``; raises if one announced another read
        there."""
        keys = [self._read_key(r) for r in peers]
        if not self._store.check(keys):  # a peer has not opened its reads yet
            return peers
        waiting = []
        for peer, value in zip(peers, self._store.multi_get(keys)):
            theirs, _, their_what = value.decode().partition("\t")
            if theirs == str(point) and their_what != what:
                raise OneRankReadError(
                    f"{what} on rank {self.rank} while rank {peer} runs {their_what} at the same point: reads of "
                    f"sharded values must be the same on every rank. {way_out}")
            if theirs != str(point):
                waiting.append(peer)
        return waiting

    def _check_progress(self, waiting: list[int], point: int, what: str, way_out: str) -> None:
        """Raises if a peer that has not joined is past ``point`` (it issued a collective there)."""
        if self.progress_key is None:
            return
        keys = [self.progress_key(r) for r in waiting]
        if not self._store.check(keys):
            return
        for peer, value in zip(waiting, self._store.multi_get(keys)):
            if int(value) > point:
                raise OneRankReadError(
                    f"{what} ran on rank {self.rank}, but rank {peer} went on without it: each rank holds only its "
                    f"rows, so this read needs every rank to run it at the same point. {way_out}")

    def _read_key(self, rank: int) -> str:
        return f"{self._prefix}read/{rank}"
