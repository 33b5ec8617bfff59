"""A pytest plugin for running Lightning's own test suite with ZeRO in place of DDP (see README.md beside this file).

Loaded with ``-p zero_swap`` (``run.py`` puts this folder on ``PYTHONPATH``), configured by environment variables so
that the processes Lightning's ``"ddp"`` launcher starts (which run the same pytest command again, one per rank) do
the same:

- ``ZERO_CONFORMANCE_STAGE``: ``1``, ``2`` or ``3`` replaces every ``DDPStrategy`` the Trainer's connector builds
  with a ``ZeroStrategy`` of that stage; empty or unset changes nothing (the DDP baseline).
- ``ZERO_CONFORMANCE_LOG``: a JSON-lines file every process appends its records to.

[Note: where the strategy is swapped]
The swap happens in ``_AcceleratorConnector._init_strategy``, after Lightning resolved the user's ``strategy=``
(a registered name such as ``"ddp_spawn_find_unused_parameters_true"``, ``"auto"`` on 2 CPU devices, or a
``DDPStrategy(...)`` instance) and before it sets the accelerator, devices, precision and launcher on it. So the
``ZeroStrategy`` gets exactly what the ``DDPStrategy`` would have had: the same start method, timeout, process group
backend, ``find_unused_parameters``, and the user's accelerator, devices, cluster environment, checkpoint IO and
precision plugin where the instance carried them. Only the exact class is swapped: a test's own subclass of
``DDPStrategy`` (its overrides are what it tests) and Lightning's subclasses (DeepSpeed) are left alone, and recorded.
DDP's communication options that ZeRO has no use for (``ddp_comm_hook``, ``static_graph``, ``model_averaging_period``,
...) are dropped and recorded.

[Note: the swapped strategy is the test's own object]
A test that built ``strategy = DDPStrategy(...)`` and passed it to the Trainer may go on using ``strategy``
(``strategy._launcher``, ``strategy.model``) rather than ``trainer.strategy``. That reference is not the
``ZeroStrategy`` the connector now holds, but the DDPStrategy the Trainer never configured (no launcher, no model),
and the test would fail on the harness, not on ZeRO (``test_multiprocessing.py::test_transfer_weights`` did). So
the DDPStrategy object is made to stand for the ``ZeroStrategy``: its class becomes a ``DDPStrategy`` subclass whose
every attribute read, write and deletion goes to the ``ZeroStrategy`` (``__class__`` included, so that
``isinstance(strategy, ZeroStrategy)`` holds). The object cannot simply become a ``ZeroStrategy``: the two classes'
bases lay an instance out differently, and ``__class__`` assignment refuses.

Records (one JSON object a line, ``test`` the pytest node id, ``pid``, ``root`` true in the pytest process run.py
started and false in a rank it launched):

- ``{"event": "swap", "from": ..., "to": ..., "dropped": [...]}`` or ``{"event": "kept", "class": ...}`` for a
  ``DDPStrategy`` subclass;
- ``{"event": "launch", "fn": "fit", "strategy": ..., "start_method": ..., "accelerator": "cpu", "world_size": 2}``
  each time ``fit``/``validate``/``test``/``predict`` runs (in the process that calls it, before any launcher);
- ``{"event": "report", "when": ..., "outcome": ..., "message": ..., "zero_frames": [...]}`` for each test phase,
  the failure's full text going to ``<log>.d/<test>.txt``.
"""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

STAGE_ENV = "ZERO_CONFORMANCE_STAGE"
LOG_ENV = "ZERO_CONFORMANCE_LOG"
_ROOT_PID_ENV = "ZERO_CONFORMANCE_ROOT_PID"
#: DDP's start methods, as the suffix of the zero strategy with the same one (strategy.py's ``_START_METHODS``).
_SUFFIX_OF_START_METHOD = {"popen": "", "spawn": "_spawn", "fork": "_fork", "forkserver": None}
#: DDPStrategy's own keyword arguments that ZeroStrategy takes under another name.
_RENAMED_DDP_KWARGS = {"find_unused_parameters": "find_unused_parameters", "bucket_cap_mb": "bucket_mb"}
_ZERO_FRAME = re.compile(r"(lightning_zero/[\w/]+\.py)(?:\", line |:)(\d+)")


def _stage() -> int | None:
    value = os.environ.get(STAGE_ENV, "")
    if value not in ("", "1", "2", "3"):
        raise pytest.UsageError(f"{STAGE_ENV}={value!r} is invalid: allowed values are '', '1', '2' or '3'")
    return int(value) if value else None


_running: list[str] = [""]  # the node id of the test this process runs (a test may clear the environment)


def _current_test() -> str:
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    return current.rsplit(" (", 1)[0] or _running[0]


def pytest_runtest_logstart(nodeid: str) -> None:
    _running[0] = nodeid


def record(event: str, **fields: Any) -> None:
    """Append one record to the log (every process opens it in append mode; one line is one ``write``)."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = {"event": event, "test": fields.pop("test", None) or _current_test(), "pid": os.getpid(),
            "root": os.environ.get(_ROOT_PID_ENV) == str(os.getpid()), **fields}
    with open(path, "a") as file:
        file.write(json.dumps(line, default=str) + "\n")


# ------------------------------------------------------------------------------------------------------- the swap


def zero_strategy_like(ddp: Any, stage: int) -> tuple[Any, list[str]]:
    """A ``ZeroStrategy`` of ``stage`` with ``ddp``'s launch settings, options and user-set plugins; and the DDP
    options it had to drop."""
    from lightning_zero import ZeroStrategy

    options: dict[str, Any] = {}
    dropped = []
    for name, value in ddp._ddp_kwargs.items():
        if name in _RENAMED_DDP_KWARGS:
            if value is not None:  # DDP's None means its default; so does leaving ZeRO's option out
                options[_RENAMED_DDP_KWARGS[name]] = value
        else:
            dropped.append(name)
    for name in ("_ddp_comm_state", "_ddp_comm_hook", "_ddp_comm_wrapper", "_model_averaging_period"):
        if getattr(ddp, name) is not None:
            dropped.append(name.lstrip("_"))
    zero = ZeroStrategy(
        stage=stage,
        accelerator=ddp._accelerator,
        parallel_devices=ddp.parallel_devices,
        cluster_environment=ddp.cluster_environment,
        checkpoint_io=ddp._checkpoint_io,
        precision_plugin=ddp._precision_plugin,
        process_group_backend=ddp._process_group_backend,
        timeout=ddp._timeout if ddp._timeout is not None else timedelta(minutes=30),
        start_method=ddp._start_method,
        **options,
    )
    return zero, dropped


def stand_for(ddp: Any, zero: Any) -> None:
    """Make the ``DDPStrategy`` object ``ddp`` stand for the ``ZeroStrategy`` ``zero`` (see [Note: the swapped
    strategy is the test's own object])."""
    from lightning.pytorch.strategies import DDPStrategy

    class SwappedDDPStrategy(DDPStrategy):
        def __getattribute__(self, name: str) -> Any:
            return getattr(zero, name)

        def __setattr__(self, name: str, value: Any) -> None:
            setattr(zero, name, value)

        def __delattr__(self, name: str) -> None:
            delattr(zero, name)

    ddp.__class__ = SwappedDDPStrategy


def _describe(strategy: Any) -> str:
    name = type(strategy).__name__
    if name == "ZeroStrategy":
        return f"ZeroStrategy(stage={strategy.config.stage}, start_method={strategy._start_method!r})"
    return f"{name}(start_method={getattr(strategy, '_start_method', None)!r})"


def _install_swap(stage: int | None) -> None:
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer import call
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    init_strategy = _AcceleratorConnector._init_strategy

    def swapping_init_strategy(connector: _AcceleratorConnector) -> None:
        init_strategy(connector)
        strategy = connector.strategy
        if not isinstance(strategy, DDPStrategy) or type(strategy).__name__ == "ZeroStrategy":
            return
        if type(strategy) is not DDPStrategy:
            record("kept", **{"class": f"{type(strategy).__module__}.{type(strategy).__qualname__}"})
            return
        if stage is None:
            return
        before = _describe(strategy)
        connector.strategy, dropped = zero_strategy_like(strategy, stage)
        stand_for(strategy, connector.strategy)
        record("swap", **{"from": before, "to": _describe(connector.strategy), "dropped": dropped})

    call_and_handle_interrupt = call._call_and_handle_interrupt

    def recording_call(trainer: Any, trainer_fn: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = trainer.strategy
        devices = getattr(strategy, "parallel_devices", None) or [strategy.root_device]
        record(
            "launch",
            fn=trainer_fn.__name__.strip("_").removesuffix("_impl"),
            strategy=_describe(strategy),
            exact_ddp=type(strategy) is DDPStrategy or type(strategy).__name__ == "ZeroStrategy",
            accelerator=type(trainer.accelerator).__name__,
            world_size=len(devices) * getattr(strategy, "num_nodes", 1),
        )
        return call_and_handle_interrupt(trainer, trainer_fn, *args, **kwargs)

    _AcceleratorConnector._init_strategy = swapping_init_strategy
    call._call_and_handle_interrupt = recording_call


# --------------------------------------------------------------------------------------------------- pytest hooks


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(_ROOT_PID_ENV, str(os.getpid()))  # inherited by the ranks a launcher starts
    stage = _stage()
    if stage is not None:
        import lightning_zero  # noqa: F401  (registers the zero strategy names)
    _install_swap(stage)


def _failure_text(report: pytest.TestReport) -> tuple[str, str]:
    text = str(report.longrepr) if report.longrepr is not None else ""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else (text.strip().splitlines() or [""])[-1]
    return message, text


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and report.outcome == "passed":
        return
    fields: dict[str, Any] = {"when": report.when, "outcome": report.outcome, "duration": round(report.duration, 2)}
    if report.outcome == "skipped":
        fields["message"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
    elif report.outcome == "failed":
        message, text = _failure_text(report)
        fields["message"] = message
        fields["zero_frames"] = [f"{path}:{line}" for path, line in _ZERO_FRAME.findall(text)]
        log = os.environ.get(LOG_ENV)
        if log:
            folder = Path(log + ".d")
            folder.mkdir(exist_ok=True)
            name = re.sub(r"[^\w.=-]+", "_", report.nodeid)[-180:]
            suffix = "" if os.environ.get(_ROOT_PID_ENV) == str(os.getpid()) else f".pid{os.getpid()}"
            (folder / f"{name}.{report.when}{suffix}.txt").write_text(text)
    record("report", test=report.nodeid, **fields)


def _condition(mark: pytest.Mark) -> bool:
    condition = mark.args[0] if mark.args else mark.kwargs.get("condition", False)
    return bool(condition) and not isinstance(condition, str)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """With ``ZERO_CONFORMANCE_COLLECT=1``, record each collected test and whether a skip marker's condition holds
    (so that run.py launches a standalone test in a process of its own only where it can run)."""
    if os.environ.get("ZERO_CONFORMANCE_COLLECT") != "1":
        return
    for item in items:
        skips = [m for m in item.iter_markers() if m.name == "skip" or (m.name == "skipif" and _condition(m))]
        record("collected", test=item.nodeid, skipped=bool(skips),
               standalone=any(m.name == "skipif" and m.kwargs.get("standalone") for m in item.iter_markers()))
