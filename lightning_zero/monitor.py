"""ZeroMonitor: what a run costs per rank, for any data-parallel strategy.

Per training step it measures the model-state bytes each rank holds (parameters, gradients, optimizer states, counted
from the tensors by ``lightning_zero.memory``, and where they live: device, host memory, disk), the bytes the
strategy's collectives moved (``strategy.comm_stats``, when the strategy keeps one) and of them what crossed to other
nodes, and the throughput; it logs them through ``pl_module.log`` to whatever logger the Trainer has, and sets them
against the memory and communication models of ``estimate.py``: what this option should hold and move, and what DDP
would hold. What the report says, and how it is summarized, is monitor_report.py's ([Note: the monitor under hybrid
sharding], [Note: what the report says of torch.compile]); this module measures.

[Note: where the report comes from]
Every rank measures; at the end of training rank 0 owns the summary (the memory figures are the largest over ranks).
With the ``popen`` start method rank 0 is the launching process, so ``report()`` reads the summary it measured. With
``fork`` or ``spawn`` the launching process only waits for the workers and runs no callback, so rank 0 also writes
the summary to ``summary_file`` and ``report()`` in the launching process reads it from there.

[Note: timing a step on a GPU]
A step's time is taken from where its first batch starts to where its optimizer step has run. On a CPU the host's
clock measures it: the work is done when the host gets there. On a GPU the host runs ahead of the device, and
``torch.cuda.synchronize`` to catch up would wait for every stream, the parameter all-gathers that zero1/zero2 leave
in flight to overlap the next forward included: each step would pay for them in full, and the figure would hide the
overlap it is meant to show. So the two points are CUDA events recorded on the current (compute) stream, whose time
between them ``elapsed_time`` gives once the device has passed both: the gathers are counted where the compute stream
waits for them, in the next step. A step's events are read without waiting, when a later step ends and the device
has passed them (``Event.query``), and at the end of training, waiting for the last event only: so the throughput
logged at a step is that of the latest step the device has finished (on a CPU, the step itself).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only

from lightning_zero.host_memory import host_memory
from lightning_zero.memory import ModelStateBytes, glibc_heap_settings, model_state_bytes
from lightning_zero.memory_policy import describe
from lightning_zero.monitor_report import (
    CompileStats,
    MonitorSummary,
    StepRecord,
    _summarize,
    compile_counts,
    format_report,
    option_of,
)

# Kept importable from here, where they were before monitor_report.py was split off.
__all__ = ["CompileStats", "MonitorSummary", "StepRecord", "ZeroMonitor", "compile_counts", "format_report",
           "option_of"]


@dataclass(frozen=True)
class _TimedStep:
    """A step whose time is known once the clock can read it: its start and end marks, bytes moved, items."""

    start: Any
    end: Any
    comm_bytes: int | None
    items: int
    cross_bytes: int | None = None


class _HostClock:
    """Steps timed on the host's clock: a CPU run (see [Note: timing a step on a GPU])."""

    def mark(self) -> float:
        return time.perf_counter()

    def passed(self, mark: float) -> bool:
        return True

    def wait(self, mark: float) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class _CudaClock:
    """Steps timed by CUDA events on ``device``'s current stream (see [Note: timing a step on a GPU])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def passed(self, mark: torch.cuda.Event) -> bool:
        return mark.query()

    def wait(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000


class ZeroMonitor(pl.Callback):
    """Logs per-rank model-state bytes, communication bytes per step and throughput; ``report()`` sums them up.

    Args:
        summary_file: where rank 0 writes the summary as JSON at the end of training (see
            [Note: where the report comes from]); ``None`` keeps it in memory only.
    """

    def __init__(self, summary_file: str | None = None) -> None:
        self.summary_file = Path(summary_file) if summary_file is not None else None
        self.summary: MonitorSummary | None = None
        self._steps: list[StepRecord] = []
        self._timing: list[_TimedStep] = []
        self._clock: _HostClock | _CudaClock = _HostClock()
        self._held: tuple[int, ...] | None = None
        self._owned_state: tuple[int, ...] | None = None
        self._step_start: tuple[Any, tuple[int, int | None] | None] | None = None
        self._items = 0
        self._last_global_step = 0
        self._unit = "samples/s"
        self._host_budget: str | None = None
        self._compiles: list[tuple] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._compiles = [compile_counts()]
        self.summary, self._steps, self._timing, self._held, self._owned_state = None, [], [], None, None
        self._step_start, self._items, self._last_global_step = None, 0, trainer.global_step
        device = trainer.strategy.root_device
        self._clock = _CudaClock(device) if device.type == "cuda" else _HostClock()
        self._host_budget = host_memory().describe(trainer.num_devices)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._step_start is None:
            self._step_start = (self._clock.mark(), _comm_total(trainer))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        items, self._unit = _count_items(batch)
        self._items += items
        if trainer.global_step == self._last_global_step or self._step_start is None:
            return  # accumulating gradients: the optimizer step has not happened yet
        started, comm_at_start = self._step_start
        comm, cross = _comm_since(comm_at_start, _comm_total(trainer))
        self._timing.append(_TimedStep(started, self._clock.mark(), comm, self._items, cross))
        self._step_start, self._items, self._last_global_step = None, 0, trainer.global_step
        if len(self._compiles) == 1:
            self._compiles.append(compile_counts())
        held = _held_bytes(trainer, pl_module)
        if self._held is None:  # optimizer states exist from the first step on; one gather is enough
            self._held = _largest_over_ranks(trainer, pl_module, held)
            self._owned_state = _owned_state_per_rank(trainer, pl_module, held)
        finished = self._read_finished_steps()
        self._log(pl_module, held, comm, finished[-1] if finished else None, trainer.world_size)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timing:
            self._clock.wait(self._timing[-1].end)
            self._read_finished_steps()
        if not self._steps or self._held is None:
            return
        compiled = CompileStats.between(*self._compiles, compile_counts()) if len(self._compiles) == 2 else None
        self.summary = dataclasses.replace(_summarize(trainer, pl_module, self._held, self._steps, self._unit),
                                           host_budget=self._host_budget, memory_mode=_memory_mode(trainer),
                                           glibc_heap=glibc_heap_settings() or None,
                                           optimizer_per_rank=self._owned_state, compiled=compiled)
        self._write_summary()

    def report(self) -> str:
        """The run's figures as a few lines of text, in the process that launched the run too."""
        summary = self.summary
        if summary is None and self.summary_file is not None and self.summary_file.is_file():
            summary = MonitorSummary.from_json(self.summary_file.read_text())
        if summary is None:
            return "ZeroMonitor: no training step was measured"
        return format_report(summary)

    @rank_zero_only
    def _write_summary(self) -> None:
        if self.summary_file is not None and self.summary is not None:
            self.summary_file.parent.mkdir(parents=True, exist_ok=True)
            self.summary_file.write_text(self.summary.to_json())

    def _read_finished_steps(self) -> list[StepRecord]:
        """The steps, oldest first, whose end the clock has passed, moved to the records (the device is not waited
        for: see [Note: timing a step on a GPU])."""
        finished = []
        while self._timing and self._clock.passed(self._timing[0].end):
            timed = self._timing.pop(0)
            finished.append(StepRecord(self._clock.seconds(timed.start, timed.end), timed.comm_bytes, timed.items,
                                       timed.cross_bytes))
        self._steps.extend(finished)
        return finished

    def _log(
        self,
        pl_module: pl.LightningModule,
        held: ModelStateBytes,
        comm_bytes: int | None,
        finished: StepRecord | None,
        world_size: int,
    ) -> None:
        """This step's bytes, and the throughput of ``finished``, the latest step timed (if any yet)."""
        figures = {
            "zero/params_bytes": held.params,
            "zero/grads_bytes": held.grads,
            "zero/optimizer_bytes": held.optimizer,
            "zero/model_state_bytes": held.total,
            "zero/device_bytes": held.device,
            "zero/host_bytes": held.host,
            "zero/disk_bytes": held.disk,
            "zero/buffer_bytes": held.buffers,
        }
        if finished is not None:
            figures[f"zero/{self._unit.replace('/', '_per_')}"] = finished.items * world_size / finished.seconds
        if comm_bytes is not None:
            figures["zero/comm_bytes_per_step"] = comm_bytes
        pl_module.log_dict({k: float(v) for k, v in figures.items()}, on_step=True, on_epoch=False)


def _held_bytes(trainer: pl.Trainer, pl_module: pl.LightningModule) -> ModelStateBytes:
    counter = getattr(trainer.strategy, "model_state_bytes", None)
    if callable(counter):  # a ZeRO strategy also counts gradient storage held outside ``.grad``
        return counter()
    return model_state_bytes(pl_module, trainer.optimizers)


def _largest_over_ranks(
    trainer: pl.Trainer, pl_module: pl.LightningModule, held: ModelStateBytes
) -> tuple[int, ...]:
    """(params, grads, optimizer, device, host, disk), each the largest over ranks."""
    figures = [held.params, held.grads, held.optimizer, held.device, held.host, held.disk]
    local = torch.tensor(figures, dtype=torch.int64, device=pl_module.device)
    largest = trainer.strategy.reduce(local, reduce_op="max")
    return tuple(int(v) for v in largest.tolist())


def _owned_state_per_rank(trainer: pl.Trainer, pl_module: pl.LightningModule,
                          held: ModelStateBytes) -> tuple[int, ...] | None:
    """Every rank's optimizer-state bytes where an optimizer owns whole parameters (else ``None``: rows are even)."""
    runtime = getattr(trainer.strategy, "_runtime", None)
    if runtime is None or not any(o.ownership is not None for o in runtime.optimizers.values()):
        return None
    local = torch.tensor([held.optimizer], dtype=torch.int64, device=pl_module.device)
    return tuple(int(v) for v in trainer.strategy.all_gather(local).reshape(-1).tolist())


def _memory_mode(trainer: pl.Trainer) -> str | None:
    """Whether a ZeroStrategy run held lean or fast between steps, and why; ``None`` for other strategies."""
    runtime = getattr(trainer.strategy, "_runtime", None)
    config = getattr(trainer.strategy, "config", None)
    if runtime is None or config is None:
        return None
    return describe(runtime.lean, config)


def _comm_total(trainer: pl.Trainer) -> tuple[int, int | None] | None:
    """The strategy's byte counters so far, ``(total, sent to other nodes)``; ``None`` where it keeps none."""
    stats = getattr(trainer.strategy, "comm_stats", None)
    return (stats.total_bytes, getattr(stats, "cross_group_bytes", None)) if stats is not None else None


def _comm_since(start: tuple[int, int | None] | None, now: tuple[int, int | None] | None) -> tuple[int | None, ...]:
    """Bytes moved and bytes sent to other nodes between two readings of ``_comm_total``."""
    if start is None or now is None:
        return None, None
    cross = now[1] - start[1] if now[1] is not None and start[1] is not None else None
    return now[0] - start[0], cross


def _count_items(batch: Any) -> tuple[int, str]:
    """Tokens in the first integer tensor of the batch (token ids), else samples in its first tensor."""
    tensors = _tensors(batch)
    for t in tensors:
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return t.numel(), "tokens/s"
    return (len(tensors[0]) if tensors and tensors[0].ndim else 1), "samples/s"


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in _tensors(item)]
    return []
