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
(``issued_collectives``). Every rank issues the same
collectives in the same order (see [Note: how the order of collectives is owned] in collectives.py), so ranks that
reach the same read have the same count, and a rank whose count is already past it has issued a collective there
instead of the read: it went on without it. A waiting rank asks the peers that have not joined for their count: each
rank runs a responder thread that waits in the store for such questions (``Store.wait``: no polling) and answers
with its count at once, even while its training thread is blocked in a collective (the count is read from c10d
without touching the group). The reader asks again every ``ASK_EVERY_S``. So:

* every rank runs the read: they all publish it, and the collective runs as before (the cost: a store round trip
  or two per read, for reads that are not norms);
* a rank runs it alone: a peer's count passes it as soon as that peer issues its next collective, and the reader
  raises :class:`OneRankReadError` naming the call, the rank that went on, and the supported ways; the error goes
  through Lightning's ``on_exception``, the watchdog publishes it, and the peers, blocked in a collective the
  reader will never issue, end with an error naming the reading rank (watchdog.py);
* two ranks run different reads at the same point: the first to see it raises, naming both.

A peer that stays behind without issuing anything (a long computation of its own, or a wait this count does not see:
a store-based barrier) is waited for, up to the strategy's ``timeout``; a peer that died is the watchdog's to report.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import default_pg_timeout

from lightning_zero.sharding.unit_order import SharedBoard
from lightning_zero.store_calls import store_client

#: How often a waiting reader asks the peers that have not joined how far they are.
ASK_EVERY_S = 0.25
#: The longest sleep between two looks at the peers' announcements.
MAX_SLEEP_S = 0.02
#: One namespace per ``JoinedReads`` made in this process: every rank makes them in the same order (one per setup).
_GENERATIONS = itertools.count()
_STOP = "stop"


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
    """Reads every rank of a group must join (see [Note: a read that runs on one rank]). ``progress``: this rank's
    count of issued collectives; ``timeout_s``: how long a peer that neither joined nor went on is waited for."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float,
                 progress: Callable[[], int] = issued_collectives) -> None:
        self.rank, self.world_size = rank, world_size
        self.progress, self.timeout_s = progress, timeout_s
        self._prefix = f"lightning_zero/reads/{next(_GENERATIONS)}/"
        # The training thread asks through the process group's own client; the responder, which blocks in
        # ``wait``, has a connection of its own. One more per setup at most: with two, the store of a test that fits
        # five times in a row with a 2 s failure timeout went unanswered for over 2 s in 4 runs of 10.
        self._client = store
        self._listener_client = store_client(store, None)
        self._thread: threading.Thread | None = None

    @classmethod
    def open(cls, timeout: timedelta | None) -> JoinedReads | None:
        """Over the default process group's store, its responder started; ``None`` with one rank. ``timeout``: the
        process group's (``None``: torch's default)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        store = dist.distributed_c10d._get_default_store()
        reads = cls(store, dist.get_rank(), dist.get_world_size(), (timeout or default_pg_timeout).total_seconds())
        reads.start()
        return reads

    def start(self) -> None:
        self._client.set(self._read_key(self.rank), "")
        self._thread = threading.Thread(target=self._answer, name=f"lightning_zero-reads-{self.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the responder (it answers its next question with nothing and returns)."""
        if self._thread is None:
            return
        try:
            question = self._client.add(self._asked_key(self.rank), 1)
            self._client.set(self._question_key(self.rank, question), _STOP)
        except dist.DistError:
            pass  # the store is gone, and the daemon thread with it
        self._thread.join(timeout=2.0)
        self._thread = None

    # ---------------------------------------------------------------------------------------------------- joining

    def join(self, what: str, way_out: str, ranks: Sequence[int] | None = None) -> None:
        """Wait until every rank of ``ranks`` (global ranks; default: all) is about to run the read ``what`` at this
        point, or raise :class:`OneRankReadError` (naming ``way_out``) once one of them is seen past it."""
        point = self.progress()
        self._client.set(self._read_key(self.rank), f"{point}\t{what}")
        peers = [r for r in (range(self.world_size) if ranks is None else ranks) if r != self.rank]
        started = asked_at = time.monotonic()
        pending: dict[int, int] = {}  # peer -> the question whose answer is awaited
        sleep = 0.0
        while waiting := self._not_joined(peers, point, what, way_out):
            now = time.monotonic()
            self._check_answers(pending, point, what, way_out)
            if now - asked_at >= ASK_EVERY_S or (not pending and now - started > MAX_SLEEP_S):
                pending.update({peer: self._ask(peer) for peer in waiting if peer not in pending})
                asked_at = now
            if now - started > self.timeout_s:
                raise OneRankReadError(
                    f"{what} on rank {self.rank}: rank(s) {waiting} neither ran it nor went on within "
                    f"{self.timeout_s:g} s (the strategy's timeout). {way_out}")
            sleep = min(MAX_SLEEP_S, sleep * 2 or 1e-4)
            time.sleep(sleep)

    def _not_joined(self, peers: list[int], point: int, what: str, way_out: str) -> list[int]:
        """The peers that have not announced the read ``what`` at ``point``; raises if one announced another read
        there."""
        keys = [self._read_key(r) for r in peers]
        if not self._client.check(keys):  # a peer has not started yet
            return peers
        waiting = []
        for peer, value in zip(peers, self._client.multi_get(keys)):
            theirs, _, their_what = value.decode().partition("\t")
            if theirs == str(point) and their_what != what:
                raise OneRankReadError(
                    f"{what} on rank {self.rank} while rank {peer} runs {their_what} at the same point: reads of "
                    f"sharded values must be the same on every rank. {way_out}")
            if theirs != str(point):
                waiting.append(peer)
        return waiting

    def _check_answers(self, pending: dict[int, int], point: int, what: str, way_out: str) -> None:
        """Take the answers that came in; raises if a peer is past ``point`` (it issued a collective there)."""
        for peer, question in list(pending.items()):
            answer = self._answer_of(peer, question)
            if answer is None:
                continue
            del pending[peer]
            if answer > point:
                raise OneRankReadError(
                    f"{what} ran on rank {self.rank}, but rank {peer} went on without it: each rank holds only its "
                    f"rows, so this read needs every rank to run it at the same point. {way_out}")

    def _ask(self, peer: int) -> int:
        question = self._client.add(self._asked_key(peer), 1)
        self._client.set(self._question_key(peer, question), str(self.rank))
        return question

    def _answer_of(self, peer: int, question: int) -> int | None:
        key = self._answer_key(peer, question)
        if not self._client.check([key]):
            return None
        answer = int(self._client.get(key))
        self._client.delete_key(key)
        return answer

    # ------------------------------------------------------------------------------------------------- answering

    def _answer(self) -> None:
        """The responder: answer each question put to this rank with its count of issued collectives."""
        client, question = self._listener_client, 1
        while True:
            key = self._question_key(self.rank, question)
            try:
                client.wait([key], timedelta(days=1))
                asked_by = client.get(key).decode()
                client.delete_key(key)
                if asked_by == _STOP:
                    return
                client.set(self._answer_key(self.rank, question), str(self.progress()))
            except dist.DistError as err:
                if "timeout" in str(err).lower():
                    continue
                return  # the store is gone: the watchdog reports it
            question += 1

    # ------------------------------------------------------------------------------------------------------- keys

    def _read_key(self, rank: int) -> str:
        return f"{self._prefix}read/{rank}"

    def _asked_key(self, rank: int) -> str:
        return f"{self._prefix}asked/{rank}"

    def _question_key(self, rank: int, question: int) -> str:
        return f"{self._prefix}question/{rank}/{question}"

    def _answer_key(self, rank: int, question: int) -> str:
        return f"{self._prefix}answer/{rank}/{question}"
