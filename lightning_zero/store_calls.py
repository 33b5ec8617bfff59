"""Store calls with a deadline, for the watchdog (watchdog.py): a store client of its own, and ``StoreCalls``, which
runs the calls on a thread of its own so that the caller waits at most the call's deadline.

[Note: a deadline on every store call]
A store client's own timeout does not bound every call: across a network partition (tests/cluster.py) a rank's
heartbeat thread sat in ``TCPStore.add`` 45 s past its 30 s timeout (the request is sent into the socket's buffer,
and the reply is then awaited with no deadline until TCP itself gives up, minutes later), so the cut-off node's ranks
never ended. So every store call the watchdog makes goes through ``StoreCalls``: a daemon thread with a connection of its
own runs the calls one at a time, and the caller waits at most the call's deadline, then raises
``StoreUnreachable`` (a ``DistError``, as the store's own failures), leaving the stuck call behind on that thread;
calls queued behind a stuck one meet their own deadlines the same way. The heartbeat thread gives each call
``failure_timeout_s``: a store silent that long is lost, as a silent peer is, and the process ends one heartbeat and
the grace period later (a partition ends both sides within ``failure_timeout_s + heartbeat_s + grace_s``). The
training thread, already failing, gives its calls ``4 * heartbeat_s`` (at least 5 s), ``stop`` ``heartbeat_s`` (at
least 1 s).
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist


class StoreUnreachable(dist.DistError):
    """A store call did not complete within its deadline (see [Note: a deadline on every store call])."""


def store_client(store: dist.Store, timeout_s: float | None) -> dist.Store:
    """A connection of its own to ``store`` (``Store.clone``), with its own timeout (``None``: the store's); where
    a store lacks ``clone`` (in-memory stores), the shared client, whose timeout is left alone."""
    if not hasattr(store, "clone"):
        return store
    client = store.clone()
    if timeout_s is not None:
        client.set_timeout(timedelta(seconds=timeout_s))
    return client


class StoreCalls:
    """Store calls with deadlines (see [Note: a deadline on every store call]): run one at a time by a daemon thread on
    a connection of its own; ``calls(deadline_s, method, *args)`` returns the result or raises the store's error, or
    ``StoreUnreachable`` once ``deadline_s`` has passed."""

    def __init__(self, store: dist.Store, name: str) -> None:
        self._store = store_client(store, None)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def __call__(self, deadline_s: float, method: str, *args: Any) -> Any:
        done, result = threading.Event(), []
        self._requests.put((method, args, result, done))
        if not done.wait(deadline_s):
            raise StoreUnreachable(f"the store did not answer {method} within {deadline_s:g} s")
        value, error = result
        if error is not None:
            raise error
        return value

    def close(self) -> None:
        """End the thread once the calls queued before have run (at once if none is stuck)."""
        self._requests.put(None)

    def _serve(self) -> None:
        while (request := self._requests.get()) is not None:
            method, args, result, done = request
            try:
                result.extend((getattr(self._store, method)(*args), None))
            except Exception as err:  # handed to the caller, which raises it
                result.extend((None, err))
            done.set()
