"""The watchdog in one process: two ranks' watchdogs share an in-memory store, this thread plays rank 0's training
thread. (A thread blocked in a collective, where the watchdog ends the process, is covered with real ranks in
test_rank_failure.py.)"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_zero.offload.files import FileStore
from lightning_zero.watchdog import EXIT_CODE, PROBE_S, PeerFailure, StoreUnreachable, Watchdog, _Calls, _exit

HEARTBEAT_S, TIMEOUT_S = 0.1, 1.0


@pytest.fixture
def pair():
    """Watchdogs of rank 0 and rank 1 over one store, under a fresh namespace; both stopped at the end (a
    watchdog left running would end this process once its grace period is over)."""
    store, namespace = dist.HashStore(), uuid.uuid4().hex
    dogs = [Watchdog(store, r, 2, TIMEOUT_S, HEARTBEAT_S, grace_s=30.0, namespace=namespace) for r in (0, 1)]
    yield dogs
    for dog in dogs:
        dog.stop()


def _busy(seconds: float) -> None:
    """Python work in the training thread, where the watchdog's error can be raised."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


def test_a_published_failure_is_raised_in_the_training_thread_naming_the_rank(pair) -> None:
    ours, peer = pair
    ours.start()
    peer.start()
    peer.on_exception(ValueError("out of data\nsecond line"))
    started = time.monotonic()
    with pytest.raises(PeerFailure) as caught:
        _busy(5.0)
    ours.on_exception(caught.value)
    assert time.monotonic() - started < 3 * HEARTBEAT_S
    assert caught.value.rank == 1 and str(caught.value) == "rank 1 failed: ValueError: out of data"


def test_a_silent_peer_fails_this_rank_after_the_failure_timeout(pair) -> None:
    ours, peer = pair
    peer.start()
    peer._stopping.set()  # its heartbeat thread ends without telling anyone: a frozen process or a lost machine
    ours.start()
    started = time.monotonic()
    with pytest.raises(PeerFailure, match=r"rank 1 sent no heartbeat for 1\.\d s \(failure_timeout_s=1\)") as caught:
        _busy(10.0)
    ours.on_exception(caught.value)
    # 5 heartbeats of slack: the detecting thread shares the GIL with _busy and the cores with the rest of the suite
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 5 * HEARTBEAT_S


def test_a_peer_that_stopped_cleanly_is_never_taken_for_failed(pair) -> None:
    ours, peer = pair
    ours.start()
    peer.start()
    peer.stop()
    _busy(TIMEOUT_S + 5 * HEARTBEAT_S)  # would raise PeerFailure
    assert ours.verdict is None


def test_a_rank_that_never_started_its_watchdog_is_named(pair) -> None:
    ours, _ = pair
    ours.start()
    with pytest.raises(PeerFailure, match="rank 1 never started its watchdog for 1") as caught:
        _busy(10.0)
    ours.on_exception(caught.value)


def test_on_exception_publishes_a_root_cause_and_names_it_on_the_others(pair) -> None:
    ours, peer = pair
    ours.start()
    peer.start()
    root = KeyError("tokens")
    peer.on_exception(root)
    assert not getattr(root, "__notes__", None)  # the root cause gets no note
    consequence = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    ours.on_exception(consequence)
    assert consequence.__notes__ == [
        "lightning_zero watchdog (rank 0): rank 1 failed: KeyError: 'tokens'; this error is a consequence"
    ]


def test_a_communication_error_is_blamed_on_the_peer_that_does_not_answer_a_probe(pair) -> None:
    ours, peer = pair
    ours.start()
    peer.start()
    peer._stopping.set()  # killed: its threads answer nothing any more
    error = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    started = time.monotonic()
    ours.on_exception(error)
    assert PROBE_S <= time.monotonic() - started <= PROBE_S + 0.3  # not a heartbeat period (here 0.1 s, default 2)
    assert error.__notes__ == [
        "lightning_zero watchdog (rank 0): rank 1 did not answer a probe within 0.5 s after this rank's collective "
        "failed: it died or its machine is unreachable; this error is a consequence"
    ]
    assert ours._read_failure(1.0).rank == 1  # published: the other ranks report the same cause


def test_a_live_peer_answers_a_probe_at_once_and_this_rank_is_the_root_cause() -> None:
    # A heartbeat far longer than the probe: only the listener can answer in time.
    store, namespace = dist.HashStore(), uuid.uuid4().hex
    ours, peer = (Watchdog(store, r, 2, 60.0, 20.0, grace_s=30.0, namespace=namespace) for r in (0, 1))
    try:
        ours.start()
        peer.start()
        error = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset")
        started = time.monotonic()
        ours.on_exception(error)
        assert time.monotonic() - started < PROBE_S
        assert not getattr(error, "__notes__", None)
        assert str(ours._read_failure(1.0)) == "rank 0 failed: RuntimeError: [../third_party/gloo/gloo/transport/tcp/" \
                                               "pair.cc:537] Read error: Connection reset"
    finally:
        ours.stop()
        peer.stop()


def test_a_communication_error_names_the_dead_peer_even_when_the_store_answers_slowly(pair, monkeypatch) -> None:
    # A loaded machine: every read of the counters takes as long as the whole probe. The counters are still compared
    # at least once after the probe was sent, and the peer found silent.
    ours, peer = pair
    ours.start()
    peer.start()
    peer._stopping.set()
    read_beats = ours._read_beats

    def slow_read(deadline_s):
        time.sleep(PROBE_S)
        return read_beats(deadline_s)

    monkeypatch.setattr(ours, "_read_beats", slow_read)
    error = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    ours.on_exception(error)
    assert error.__notes__[0].startswith("lightning_zero watchdog (rank 0): rank 1 did not answer a probe")


class CutStore:
    """A store (no ``clone``: one client) whose every call blocks once ``cut`` is set, as the store's connection
    across a network partition does (the reply never comes)."""

    def __init__(self) -> None:
        self.store, self.cut, self.released = dist.HashStore(), threading.Event(), threading.Event()

    def _call(self, name: str, *args):
        if self.cut.is_set():
            self.released.wait()
        return getattr(self.store, name)(*args)

    def add(self, *args):
        return self._call("add", *args)

    def check(self, *args):
        return self._call("check", *args)

    def get(self, *args):
        return self._call("get", *args)

    def multi_get(self, *args):
        return self._call("multi_get", *args)

    def multi_set(self, *args):
        return self._call("multi_set", *args)

    def compare_set(self, *args):
        return self._call("compare_set", *args)

    def wait(self, *args):
        return self._call("wait", *args)


def test_a_store_call_that_never_returns_raises_at_its_deadline() -> None:
    store = CutStore()
    calls = _Calls(store, "test-store")
    assert calls(1.0, "add", "k", 2) == 2
    store.cut.set()
    started = time.monotonic()
    with pytest.raises(StoreUnreachable, match="the store did not answer add within 0.3 s"):
        calls(0.3, "add", "k", 1)
    with pytest.raises(StoreUnreachable):  # queued behind the stuck call: its own deadline
        calls(0.3, "check", ["k"])
    assert time.monotonic() - started < 0.6 + 0.2
    store.released.set()
    calls.close()


def test_a_store_cut_off_fails_this_rank_after_the_failure_timeout() -> None:
    # Across a partition the store's calls hang instead of failing: the heartbeat thread's deadline ends the wait.
    # One watchdog (rank 1, away from the store's host): with rank 0's watchdog in the same process, whichever of the
    # two raises first would win, and rank 0's own verdict (its peer fell silent) is just as true.
    store = CutStore()
    ours = Watchdog(store, 1, 2, TIMEOUT_S, HEARTBEAT_S, grace_s=30.0, namespace="cut")
    try:
        ours.start()
        store.cut.set()
        started = time.monotonic()
        with pytest.raises(PeerFailure, match="rank 0 is gone: the process group's store") as caught:
            _busy(10.0)
        ours.on_exception(caught.value)
        assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 3 * HEARTBEAT_S
        assert "the store did not answer add within 1 s" in str(caught.value)
    finally:
        store.released.set()
        ours.stop()


def test_heartbeat_must_be_shorter_than_the_failure_timeout() -> None:
    with pytest.raises(ValueError, match="heartbeat_s=5 is invalid: it must be > 0 and below failure_timeout_s=5"):
        Watchdog(dist.HashStore(), 0, 2, failure_timeout_s=5, heartbeat_s=5)


def _hard_exit_with_offload_files(directory: str) -> None:
    store = FileStore(Path(directory))
    store.create(torch.ones(1000))
    _exit(0, "a peer failed (test)")


def test_a_process_the_watchdog_ends_leaves_no_offload_files(tmp_path) -> None:
    directory = tmp_path / "offload"
    directory.mkdir()
    child = mp.get_context("fork").Process(target=_hard_exit_with_offload_files, args=(str(directory),))
    child.start()
    child.join(30)
    assert child.exitcode == EXIT_CODE
    assert not directory.exists()
