"""The watchdog: when one rank fails, every other rank fails too, within a bounded time, naming the rank at fault.

[Note: how a rank learns that a peer failed]
Each rank runs a daemon thread that, every ``heartbeat_s`` seconds, adds 1 to its own counter in the process group's
store (the ``TCPStore`` every launcher sets up: rank 0's process hosts it, or torchrun's agent on the first node)
and reads everyone's counters and a ``failure`` key, all under a namespace of its own for each fit. Counters need
no clock agreement: a peer is silent when its counter has not moved, on this rank's monotonic clock. A failure ends in
one of four ways, all leading to one error that names the rank at fault:

- A rank raises (any exception reaching Lightning): ``on_exception`` publishes ``rank r failed: <error>`` in the
  ``failure`` key (the first writer wins, so every rank reports the same root cause).
- A rank dies (SIGKILL, out of memory, a crash, a whole node killed): on gloo the survivors' next collective raises
  at once ("Connection reset by peer", measured: 0.02 s, naming an address, not a rank; zero3 ranks waiting at the
  unit-order board of one host find its process gone within ``LIVENESS_S``: see sharding/unit_order.py).
  ``on_exception`` sees that the error is a communication error and probes the peers
  (see [Note: probing the peers]): within ``PROBE_S`` it knows which ranks no longer answer, publishes them, and
  adds a note (PEP 678) to the exception naming them.
  Lightning then re-raises the exception, note included.
- A rank or its machine goes silent without closing its connections (a node lost, a process stopped, the GIL held
  by C code): the survivors stay blocked in their collective; the thread sees the counter stand still for
  ``failure_timeout_s`` and publishes that.
- A peer published a failure while this rank was blocked in a collective (it raised but stays alive: a notebook, a
  script that catches, a slow teardown): the thread sees the ``failure`` key within one heartbeat.

In the last two cases the thread must make the training thread fail. It first raises :class:`PeerFailure` in that
thread (``PyThreadState_SetAsyncExc``), which works whenever the thread runs Python: Lightning then runs its
``on_exception`` hooks and teardown, and ``fit`` raises ``PeerFailure``. A thread blocked inside a collective never
sees it: gloo's wait cannot be interrupted (measured on torch 2.13: ``ProcessGroup.abort()``, ``shutdown()`` and
``destroy_process_group()``, on the waiting rank or on the failing one, leave the wait blocked until the process-group
timeout, 30 minutes by default). So when the error was not received within ``grace_s``, the thread prints it to
stderr and ends the process with ``os._exit(EXIT_CODE)``: no Lightning teardown, but nothing could run one anyway
(it would wait on the same collective), and a launcher (torchrun, SLURM) sees the exit at once. After the error was
received, teardown gets ``failure_timeout_s`` to finish before the same exit.

Not covered: a rank whose training thread hangs while its heartbeat thread lives (a deadlock outside collectives, an
endless loop) looks alive; the process-group timeout still ends its peers' collectives.

[Note: probing the peers]
A peer that died is found by its counter standing still, which takes more than one heartbeat period to see (2 s by
default) -- too slow when a whole node was killed and its peers should end as fast as DDP's do (in about a second).
So each rank also runs a listener thread that waits in the store (``Store.wait``, which returns when the key is set:
no polling) for its own wake key of the next probe, ``wake/<rank>/<g>``; when it is set, the listener adds 1 to the
rank's counter at once, and waits for the next. A rank whose collective failed takes the next probe number ``g``
(``add``), sets every rank's wake key of it in one request (``multi_set``), and reads the counters for ``PROBE_S``:
the ranks whose counter did not move are dead or cut off (a live one answers in a round trip, milliseconds). Probing
costs one request per rank probed, and nothing while no one fails; ``stop`` wakes its own listener to end it. The
listener's wait is the one store call without a deadline: it blocks until a probe or ``stop`` (on a daemon thread,
which the watchdog's exit does not wait for), and a store gone makes it return with an error, which ends it.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_zero.store_calls import StoreCalls, StoreUnreachable, store_client

#: Exit status of a process the watchdog ends because a peer failed: EX_UNAVAILABLE (a required service is gone).
EXIT_CODE = 69
#: Added to a rank's counter when it stops cleanly, so that its peers never take it for silent.
_DONE = 1 << 40
#: One namespace per watchdog started in this process: every rank starts them in the same order (one per fit).
_GENERATIONS = itertools.count()
#: How long a rank whose collective failed waits for its peers to answer a probe (see [Note: probing the peers]).
PROBE_S = 0.5
#: How long the listener waits for a probe in one call (it waits again after): effectively until a probe or ``stop``.
# StoreUnreachable and _Calls (StoreCalls) are kept importable from here, where they were before store_calls.py was
# split off.
_Calls = StoreCalls
__all__ = [
    "EXIT_CODE", "PROBE_S", "PeerFailure", "StoreUnreachable", "Watchdog", "cancel_before_exit", "run_before_exit",
]

_LISTEN = timedelta(days=1)


class PeerFailure(RuntimeError):
    """Another rank failed (or the store that connects the ranks is gone); ``rank`` is the one at fault, if known."""

    def __init__(self, rank: int | None, reason: str) -> None:
        self.rank = rank
        self.reason = reason
        super().__init__(f"rank {rank} {reason}" if rank is not None else reason)

    def __reduce__(self) -> tuple[Any, ...]:
        return PeerFailure, (self.rank, self.reason)


class Watchdog:
    """Heartbeats and failure announcements of one rank in ``store`` (see [Note: how a rank learns that a peer
    failed]). ``start()`` in setup, ``on_exception()`` from the strategy's ``on_exception``, ``stop()`` at the end of
    teardown. ``failure_timeout_s``: how long a peer may stay silent before this rank fails; ``heartbeat_s``: the
    period of the heartbeat and of the checks; ``grace_s``: how long the training thread gets to receive the error
    before the process exits (default ``max(1, 2 * heartbeat_s)``); ``store_in_rank0``: whether rank 0's process
    hosts the store (so that losing the store means losing rank 0), as without torchrun's agent; ``namespace``: the
    keys' prefix in the store (default: one per watchdog created in this process, the same on every rank)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        failure_timeout_s: float = 300.0,
        heartbeat_s: float = 2.0,
        grace_s: float | None = None,
        store_in_rank0: bool = True,
        namespace: str | None = None,
    ) -> None:
        if not 0 < heartbeat_s < failure_timeout_s:
            raise ValueError(
                f"heartbeat_s={heartbeat_s!r} is invalid: it must be > 0 and below "
                f"failure_timeout_s={failure_timeout_s!r}"
            )
        self.rank, self.world_size = rank, world_size
        self.failure_timeout_s, self.heartbeat_s = failure_timeout_s, heartbeat_s
        self.grace_s = max(1.0, 2 * heartbeat_s) if grace_s is None else grace_s
        self.store_in_rank0 = store_in_rank0
        prefix = f"lightning_zero/watchdog/{next(_GENERATIONS) if namespace is None else namespace}/"
        self._prefix = prefix
        self._beats = [f"{prefix}beat/{r}" for r in range(world_size)]
        self._failure_key = f"{prefix}failure"
        # Deadlines (see [Note: a deadline on every store call]): the heartbeat thread's calls get the failure
        # timeout (a store silent that long is lost); the training thread's, already failing, a short one.
        self._calls = StoreCalls(store, f"lightning_zero-watchdog-store-{rank}")
        self._slow_s, self._quick_s = failure_timeout_s, max(5.0, 4 * heartbeat_s)
        self._waker = store_client(store, None)  # the listener's own connection: it blocks in ``wait``
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._acknowledged = threading.Event()  # the training thread is handling an exception
        self._delivered = threading.Event()  # it received the watchdog's own
        self._target: int | None = None
        self._thread: threading.Thread | None = None
        self._listener: threading.Thread | None = None
        self._next_probe = 1  # the probe the listener waits for
        self.verdict: PeerFailure | None = None
        #: How far this rank is (its count of issued collectives), published each heartbeat where set (see [Note: a
        #: read that runs on one rank] in sharding/joined_reads.py).
        self.progress: Callable[[], int] | None = None

    @classmethod
    def for_process_group(
        cls, failure_timeout_s: float | None = 300.0, heartbeat_s: float = 2.0, **kwargs: Any
    ) -> Watchdog | None:
        """A watchdog over the default process group's store; None with one rank or ``failure_timeout_s=None``."""
        if failure_timeout_s is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        in_rank0 = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # else torchrun's agent hosts it
        store = dist.distributed_c10d._get_default_store()
        return cls(store, dist.get_rank(), dist.get_world_size(), failure_timeout_s, heartbeat_s,
                   store_in_rank0=in_rank0, **kwargs)

    # ------------------------------------------------------------------------------------- the training thread

    def start(self) -> None:
        """Beat once, then check every ``heartbeat_s`` in a daemon thread and answer probes in another; errors go to
        the calling thread."""
        self._target = threading.get_ident()
        self._calls(self._slow_s, "add", self._beats[self.rank], 1)
        self._publish_progress()
        self._thread = threading.Thread(target=self._run, name=f"lightning_zero-watchdog-{self.rank}", daemon=True)
        self._thread.start()
        self._listener = threading.Thread(target=self._listen, name=f"lightning_zero-probes-{self.rank}", daemon=True)
        self._listener.start()

    def on_exception(self, exception: BaseException) -> None:
        """The training thread failed: publish this rank as the root cause, or, if the error only reflects a peer's
        failure, name that peer in a note on the exception."""
        with self._lock:
            self._acknowledged.set()
            if self.verdict is not None and not self._delivered.is_set() and self._target is not None:
                _raise_in_thread(self._target, None)  # withdraw it: this thread is already failing
        if isinstance(exception, PeerFailure):
            return
        try:
            cause = self._read_failure(self._quick_s)
            if cause is None and _is_communication_error(exception):
                cause = self._probe()
            if cause is None:
                self._publish(self._quick_s, self.rank, f"failed: {_describe(exception)}")
                return
            self._publish(self._quick_s, cause.rank, cause.reason)
        except dist.DistError as err:  # the store itself is gone, and with it the rank hosting it
            cause = self._store_lost(err)
        if cause.rank != self.rank:
            _add_note(exception, f"lightning_zero watchdog (rank {self.rank}): {cause}; this error is a consequence")

    def stop(self) -> None:
        """Stop the threads and tell the peers that this rank ended cleanly (not silent). Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        deadline = max(1.0, self.heartbeat_s)
        try:
            self._calls(deadline, "add", self._beats[self.rank], _DONE)
            probe = self._next_probe  # the listener's next probe, or the one after (see [Note: probing the peers])
            self._calls(deadline, "multi_set", [self._wake_key(self.rank, g) for g in (probe, probe + 1)], ["", ""])
        except dist.DistError:
            pass  # the store is gone: nobody is left to misread the silence
        for thread in (self._thread, self._listener):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=2 * self.heartbeat_s)
        self._calls.close()

    # ---------------------------------------------------------------------------------------- the daemon threads

    def _run(self) -> None:
        seen = [0] * self.world_size
        moved = [time.monotonic()] * self.world_size
        while not self._stopping.wait(self.heartbeat_s):
            reachable = True
            try:
                self._calls(self._slow_s, "add", self._beats[self.rank], 1)
                self._publish_progress()
                verdict = self._read_failure(self._slow_s)
                beats = self._read_beats(self._slow_s)
            except dist.DistError as err:
                verdict, beats, reachable = self._store_lost(err), seen, False
            now = time.monotonic()
            for r, beat in enumerate(beats):
                if beat != seen[r]:
                    seen[r], moved[r] = beat, now
            if verdict is None or verdict.rank == self.rank:
                verdict = self._silent(seen, moved, now, self.failure_timeout_s)
            if verdict is not None and not self._acknowledged.is_set():
                self._fail(verdict, publish=reachable)
                return

    def _listen(self) -> None:
        """Answer each probe by beating at once, until ``stop`` (see [Note: probing the peers])."""
        while True:
            try:
                self._waker.wait([self._wake_key(self.rank, self._next_probe)], _LISTEN)
            except dist.DistError as err:
                if "timeout" in str(err).lower() and not self._stopping.is_set():
                    continue
                return  # the store is gone (the heartbeat thread reports it) or this rank is stopping
            if self._stopping.is_set():
                return
            self._next_probe += 1
            try:
                self._calls(self._slow_s, "add", self._beats[self.rank], 1)
            except dist.DistError:
                return

    def _silent(self, seen: list[int], moved: list[float], now: float, limit: float) -> PeerFailure | None:
        for r in range(self.world_size):
            if r != self.rank and seen[r] < _DONE and now - moved[r] >= limit:
                what = "sent no heartbeat" if seen[r] else "never started its watchdog"
                return PeerFailure(
                    r, f"{what} for {now - moved[r]:.1f} s (failure_timeout_s={self.failure_timeout_s:g}): it died, "
                    "is stopped, or its machine is unreachable"
                )
        return None

    def _fail(self, verdict: PeerFailure, publish: bool) -> None:
        """Make the training thread raise ``verdict`` (first published, where the store is ``publish``-able); end the
        process if it cannot (blocked in a collective)."""
        try:
            if publish:
                self._publish(max(1.0, self.heartbeat_s), verdict.rank, verdict.reason)
        except dist.DistError:
            pass
        with self._lock:
            if self._acknowledged.is_set() or self._stopping.is_set():
                return
            self.verdict = verdict
            _report(self.rank, f"{verdict}; raising it in the training thread")
            _raise_in_thread(self._target, _carrier(verdict, self._delivered))
        if not (_wait_any(self._acknowledged, self._stopping, timeout=self.grace_s)):
            _exit(self.rank, f"{verdict}; the training thread is blocked in a collective that cannot be interrupted")
        if not self._stopping.wait(self.failure_timeout_s):
            _exit(self.rank, f"{verdict}; teardown did not finish within failure_timeout_s={self.failure_timeout_s:g}")

    # ---------------------------------------------------------------------------------------------- the store

    def _read_failure(self, deadline_s: float) -> PeerFailure | None:
        if not self._calls(deadline_s, "check", [self._failure_key]):
            return None
        rank, _, reason = self._calls(deadline_s, "get", self._failure_key).decode().partition("\t")
        return PeerFailure(int(rank) if rank else None, reason)

    def _read_beats(self, deadline_s: float) -> list[int]:
        """Every rank's counter: one request once all exist; until then (ranks starting) key by key, 0 if absent."""
        if self._calls(deadline_s, "check", self._beats):
            return [int(v) for v in self._calls(deadline_s, "multi_get", self._beats)]
        return [int(self._calls(deadline_s, "get", k)) if self._calls(deadline_s, "check", [k]) else 0
                for k in self._beats]

    def _publish_progress(self) -> None:
        """How far this rank is (``progress``), for a read waiting on its peers (sharding/joined_reads.py)."""
        if self.progress is not None:
            self._calls(self._slow_s, "set", self.progress_key(self.rank), str(self.progress()))

    def progress_key(self, rank: int) -> str:
        """Where ``rank`` publishes how far it is, once a heartbeat."""
        return f"{self._prefix}progress/{rank}"

    def _publish(self, deadline_s: float, rank: int | None, reason: str) -> None:
        """Record the root cause unless one already is (the first failure is the one every rank reports)."""
        self._calls(deadline_s, "compare_set", self._failure_key, "", f"{'' if rank is None else rank}\t{reason}")

    def _wake_key(self, rank: int, probe: int) -> str:
        return f"{self._prefix}wake/{rank}/{probe}"

    def _probe(self) -> PeerFailure | None:
        """After a communication error: the published cause, or the peers that do not answer a probe within
        ``PROBE_S`` (see [Note: probing the peers]); ``None`` if every peer answered."""
        before = self._read_beats(self._quick_s)
        probe = self._calls(self._quick_s, "add", f"{self._prefix}probes", 1)
        peers = [r for r in range(self.world_size) if r != self.rank]
        self._calls(self._quick_s, "multi_set", [self._wake_key(r, probe) for r in peers], [""] * len(peers))
        started = time.monotonic()
        while True:
            time.sleep(PROBE_S / 10)
            cause = self._read_failure(self._quick_s)
            if cause is not None:
                return cause
            beats = self._read_beats(self._quick_s)
            silent = [r for r in peers if beats[r] == before[r] and beats[r] < _DONE]
            waited = time.monotonic() - started
            if not silent:
                return None
            if waited >= PROBE_S:
                others = f" (as did rank{'s' if len(silent) > 2 else ''} {_ranks(silent[1:])})" if silent[1:] else ""
                return PeerFailure(silent[0], f"did not answer a probe within {waited:.1f} s after this rank's "
                                   f"collective failed{others}: it died or its machine is unreachable")

    def _store_lost(self, err: BaseException) -> PeerFailure:
        if self.store_in_rank0:
            return PeerFailure(0, f"is gone: the process group's store, which runs in its process, is unreachable "
                               f"({_describe(err)})")
        return PeerFailure(None, f"the process group's store, in the torchrun agent of the first node, is unreachable "
                           f"({_describe(err)}): that node is probably gone")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _wait_any(*events: threading.Event, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not any(e.is_set() for e in events):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _carrier(verdict: PeerFailure, delivered: threading.Event) -> type[PeerFailure]:
    """A ``PeerFailure`` subclass that raises ``verdict`` when instantiated without arguments: what
    ``PyThreadState_SetAsyncExc`` does with the class it is given. Its ``__init__`` runs in the receiving thread, so
    it also records the delivery."""

    def __init__(self: PeerFailure) -> None:
        delivered.set()
        PeerFailure.__init__(self, verdict.rank, verdict.reason)

    return type("PeerFailure", (PeerFailure,), {"__init__": __init__, "__module__": __name__})


def _raise_in_thread(ident: int | None, exception: type[BaseException] | None) -> None:
    """Raise ``exception`` (a class) in thread ``ident`` at its next Python instruction; ``None`` withdraws it."""
    if ident is not None:
        pending = ctypes.py_object(exception) if exception is not None else None  # None: NULL, which withdraws
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), pending)


def _is_communication_error(exception: BaseException) -> bool:
    """Whether the error (or one it was raised from) is a failed collective or store operation: what a rank sees
    when a peer died, rather than a fault of its own."""
    seen: set[int] = set()
    error: BaseException | None = exception
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if isinstance(error, dist.DistError) or type(error).__name__ == "CheckpointException" or any(
            marker in text for marker in ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                                          "NCCL error", "ProcessGroupNCCL")
        ):
            return True
        error = error.__cause__ or error.__context__
    return False


def _describe(exception: BaseException) -> str:
    text = str(exception).strip().splitlines()
    return f"{type(exception).__name__}: {text[0]}" if text else type(exception).__name__


def _add_note(exception: BaseException, note: str) -> None:
    if hasattr(exception, "add_note"):  # Python >= 3.11
        exception.add_note(note)
    else:
        _report(None, note)


def _report(rank: int | None, message: str) -> None:
    prefix = "lightning_zero watchdog" + (f" (rank {rank})" if rank is not None else "")
    sys.stderr.write(f"{prefix}: {message}\n")
    sys.stderr.flush()


#: What must still happen if the watchdog ends the process (``os._exit`` runs no ``finally`` and no ``atexit``):
#: removing private files, such as disk offload's.
_BEFORE_EXIT: list[Callable[[], None]] = []


def run_before_exit(action: Callable[[], None]) -> None:
    """Run ``action`` if the watchdog has to end this process (until ``cancel_before_exit(action)``)."""
    _BEFORE_EXIT.append(action)


def cancel_before_exit(action: Callable[[], None]) -> None:
    if action in _BEFORE_EXIT:
        _BEFORE_EXIT.remove(action)


def _exit(rank: int, message: str) -> None:
    _report(rank, f"{message}; exiting with code {EXIT_CODE}")
    for action in list(_BEFORE_EXIT):
        try:
            action()
        except Exception as err:  # the exit must happen: say what was left behind
            _report(rank, f"could not clean up before exiting: {err!r}")
    os._exit(EXIT_CODE)
