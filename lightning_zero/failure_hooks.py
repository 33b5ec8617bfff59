"""ZeroStrategy's failure handling: a watchdog per setup that turns a peer's death or a partition into an error in
every rank (see [Note: how a rank learns that a peer failed] in watchdog.py), and what an exception in this rank
tells the peers and the exit path (``process_groups.run_failed``: no collective at teardown after a failure).

A mixin placed before ``DDPStrategy`` in ``ZeroStrategy``'s bases; it uses the strategy's ``config``, ``_watchdog``,
``_failed`` and ``_communicating``.
"""

from __future__ import annotations

from typing_extensions import override

from lightning_zero.sharding.process_groups import run_failed
from lightning_zero.watchdog import Watchdog


class FailureHooks:
    """The watchdog's start and stop, and ``on_exception`` (see the module docstring)."""

    def _start_watchdog(self) -> None:
        """One watchdog per setup (fit, then evaluation, each start one): see [Note: how a rank learns that a peer
        failed] in watchdog.py."""
        self._stop_watchdog()
        cfg = self.config.watchdog
        self._watchdog = Watchdog.for_process_group(cfg.failure_timeout_s, cfg.heartbeat_s)
        if self._watchdog is not None:
            self._watchdog.start()

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        if self._communicating:  # not a refusal at the start of setup, which every rank raises before any collective
            run_failed()
        if self._watchdog is not None:
            self._watchdog.on_exception(exception)
        super().on_exception(exception)
