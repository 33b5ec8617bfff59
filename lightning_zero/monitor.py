"""ZeroMonitor: what a run costs per rank, for any data-parallel strategy.

Per training step it measures the model-state bytes each rank holds (parameters, gradients, optimizer states, counted
from the tensors by ``lightning_zero.memory``, and where they live: device, host memory, disk), the bytes the
strategy's collectives moved (``strategy.comm_stats``, when the strategy keeps one) and of them what crossed to other
nodes, and the throughput; it logs them through ``pl_module.log`` to whatever logger the Trainer has, and sets them
against the memory and communication models of ``estimate.py``: what this option should hold and move, and what DDP
would hold.

[Note: the monitor under hybrid sharding]
With ``shard_group_size=K`` (sharding/topology.py, [Note: hybrid sharding]) a rank holds the model states of a flat
run over a world of ``K``, not of the whole world: the memory model is the option's at ``K`` ranks. Its
communication is the option's collectives inside the group of ``K`` plus the all-reduce of its gradient shard across
the ``R = N / K`` replicas (``estimate.hybrid_communication_bytes``); the latter, ``2 Ψ_t b (R-1) / (K R)``, is what
crosses between groups, set against ``comm_stats.cross_group_bytes`` (equal when each group is one node). DDP's
column stays DDP's: every rank holds everything, whatever the topology. ZeRO++'s options change the modelled
bytes as ``estimate.communication_bytes`` counts them (qwZ's int8 gathers, hpZ's backward gathers inside
groups of ``hpz_group_size``, qgZ's two-stage exchange over the strategy's nodes). A flat run's bytes to other nodes
are measured and reported, not modelled: how much of a ring or tree crosses depends on where the nodes cut it.

[Note: where the report comes from]
Every rank measures; at the end of training rank 0 owns the summary (the memory figures are the largest over ranks).
With the ``popen`` start method rank 0 is the launching process, so ``report()`` reads the summary it measured. With
``fork`` or ``spawn`` the launching process only waits for the workers and runs no callback, so rank 0 also writes
the summary to ``summary_file`` and ``report()`` in the launching process reads it from there.

[Note: what the report says of torch.compile]
A compiled model's cost beyond its kernels is its graph breaks (each one leaves the graph, runs Python, enters the next
one) and its recompilations (each one traces and compiles a frame again). Dynamo counts both for the process
(``torch._dynamo.utils.counters``); the monitor takes the difference over ``fit`` and over its first training step:
frames compiled (in the first step, and after it: a frame compiled again is a recompilation, or a first evaluation's,
whose no-grad forward compiles its own), graphs, and the graph breaks found while tracing, by reason. Under zero3 a
unit's gather and reshard hooks are graph breaks by design (param_hooks.py, [Note: zero3 under torch.compile]): they
are counted apart from the others, which are the model's own (a logging call, data-dependent control flow).

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
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_only

from lightning_zero import estimate
from lightning_zero.config import PER_NODE, ZeroConfig
from lightning_zero.host_memory import host_memory
from lightning_zero.memory import ModelStateBytes, model_state_bytes
from lightning_zero.offload.sizing import SubgroupPlan
from lightning_zero.sharding.param_hooks import UNIT_HOOK_REASON

_DDP_PRECISION = "32-true"  # DDP's figure is reported in fp32-Adam terms whatever the run's precision (16Ψ)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step on this rank: its time (see [Note: timing a step on a GPU]), bytes moved by the strategy,
    tokens (or samples) consumed."""

    seconds: float
    comm_bytes: int | None
    items: int
    cross_bytes: int | None = None


@dataclass(frozen=True)
class MonitorSummary:
    """The figures of one run. Memory is the largest over ranks; ``(params, grads, optimizer)`` byte triples, and
    ``(device, host, disk)`` ones for where they live (each placement's largest over ranks)."""

    option: str | None
    precision: str
    world_size: int
    steps: int
    num_params: int
    trainable_params: int
    held: tuple[int, int, int]
    predicted: tuple[int, int, int] | None
    bucket_bytes: int
    ddp: tuple[int, int, int]
    comm_bytes_per_step: int | None
    ideal_comm_bytes_per_step: int | None
    throughput: float | None
    throughput_unit: str
    steps_timed: int
    placement: tuple[int, int, int] | None = None
    predicted_placement: tuple[int, int, int] | None = None
    #: Hybrid sharding's group size (``None``: flat), and the bytes a rank sent to other nodes per step, measured
    #: (``comm_stats.cross_group_bytes``) and modelled (between groups: see [Note: the monitor under hybrid sharding]).
    shard_group_size: int | None = None
    cross_bytes_per_step: int | None = None
    ideal_cross_bytes_per_step: int | None = None
    #: Where an optimizer owns whole parameters (sharding/ownership.py): each rank's optimizer-state bytes, whose
    #: spread is the assignment's imbalance.
    optimizer_per_rank: tuple[int, ...] | None = None
    #: The host budget as training started (host_memory.py: what bounds it), and disk offload's sub-groups.
    host_budget: str | None = None
    offload_subgroups: str | None = None
    #: What torch.compile did during fit (``None``: nothing was compiled): see [Note: what the report says of
    #: torch.compile].
    compiled: CompileStats | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> MonitorSummary:
        raw = json.loads(text)
        for key in ("held", "predicted", "ddp", "placement", "predicted_placement", "optimizer_per_rank"):
            if raw.get(key) is not None:
                raw[key] = tuple(raw[key])
        if raw.get("compiled") is not None:
            raw["compiled"] = CompileStats(**raw["compiled"])
        return cls(**raw)


@dataclass(frozen=True)
class CompileStats:
    """torch.compile during one fit (see [Note: what the report says of torch.compile]): frames compiled in the first
    training step and after it, graphs, graph breaks at zero3 unit hooks and the others' counts by reason."""

    frames_first_step: int
    frames_after: int
    graphs: int
    unit_breaks: int
    other_breaks: dict[str, int]

    @classmethod
    def between(cls, start: tuple, first: tuple, end: tuple) -> CompileStats | None:
        """From ``compile_counts()`` taken at fit start, after the first training step and at the end."""
        if end[0] == start[0]:
            return None
        breaks = {reason: count - start[2].get(reason, 0) for reason, count in end[2].items()}
        unit = sum(count for reason, count in breaks.items() if UNIT_HOOK_REASON in reason)
        other = {reason.strip().splitlines()[0]: count for reason, count in breaks.items()
                 if count and UNIT_HOOK_REASON not in reason}
        return cls(first[0] - start[0], end[0] - first[0], end[1] - start[1], unit, other)


def compile_counts() -> tuple[int, int, dict[str, int]]:
    """Dynamo's counts for this process: frames compiled, graphs, graph breaks by reason."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"], counters["stats"]["unique_graphs"], dict(counters["graph_break"])


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
                                           host_budget=self._host_budget,
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


def format_report(s: MonitorSummary) -> str:
    fmt = estimate.format_bytes
    option = s.option or "unknown strategy"
    trainable = "" if s.trainable_params == s.num_params else f", {s.trainable_params:,} trainable"
    group = s.shard_group_size
    hybrid = (f", hybrid sharding: {s.world_size // group} replicas of {group} ranks (model states as at world "
              f"size {group})") if group else ""
    lines = [
        f"ZeroMonitor: {option} on {s.world_size} rank(s), {s.steps} steps, precision {s.precision}, "
        f"{s.num_params:,} parameters{trainable}{hybrid}",
        f"  {'model states per rank':<22}{'measured':>14}{'model (' + option + ')':>18}{'DDP would hold':>18}",
    ]
    predicted = s.predicted or (None, None, None)
    rows = zip(("params", "grads", "optimizer"), s.held, predicted, s.ddp)
    for name, held, model, ddp in rows:
        lines.append(f"  {name:<22}{fmt(held):>14}{_maybe(model, fmt):>18}{fmt(ddp):>18}")
    model_total = sum(s.predicted) if s.predicted else None
    lines.append(f"  {'total':<22}{fmt(sum(s.held)):>14}{_maybe(model_total, fmt):>18}{fmt(sum(s.ddp)):>18}")
    lines.append(
        f"  measured / DDP: {sum(s.held) / sum(s.ddp):.2f}x"
        + (f"; plus up to {fmt(s.bucket_bytes)} of communication buckets" if s.bucket_bytes else "")
    )
    if s.optimizer_per_rank:
        mean = sum(s.optimizer_per_rank) / len(s.optimizer_per_rank)
        lines.append(
            "  optimizer states per rank (whole parameters owned by one rank each): "
            + ", ".join(fmt(b) for b in s.optimizer_per_rank)
            + (f"; the largest {max(s.optimizer_per_rank) / mean:.2f}x the mean" if mean else "")
        )
    if s.placement is not None:
        lines.append("  where they live per rank: " + _placement(s.placement, fmt))
        if s.predicted_placement is not None:
            lines.append(f"  {'model (' + option + ')':>24}: " + _placement(s.predicted_placement, fmt))
    if s.comm_bytes_per_step is None:
        lines.append("  communication per step: not counted (the strategy keeps no comm_stats)")
    else:
        ideal = s.ideal_comm_bytes_per_step
        versus = f" (model: {fmt(ideal)}, ratio {s.comm_bytes_per_step / ideal:.2f})" if ideal else ""
        lines.append(f"  communication per step and rank: {fmt(s.comm_bytes_per_step)}{versus}")
    if s.cross_bytes_per_step is not None and (s.cross_bytes_per_step or s.ideal_cross_bytes_per_step):
        ideal = s.ideal_cross_bytes_per_step
        versus = f" (model, between shard groups: {fmt(ideal)}, ratio {s.cross_bytes_per_step / ideal:.2f})" if (
            ideal) else ""
        lines.append(f"  of it sent to other nodes: {fmt(s.cross_bytes_per_step)}{versus}")
    if s.host_budget is not None:
        lines.append(f"  host budget as training started: {s.host_budget}")
    if s.offload_subgroups is not None:
        lines.append(f"  disk offload: {s.offload_subgroups}")
    if s.throughput is not None:
        lines.append(
            f"  throughput: {s.throughput:,.0f} {s.throughput_unit} over all ranks "
            f"(median step of {s.steps_timed} timed)"
        )
    if s.compiled is not None:
        lines.append(_compile_line(s.compiled))
    return "\n".join(lines)


def _compile_line(c: CompileStats) -> str:
    others = "; ".join(f"{count} {reason}" for reason, count in c.other_breaks.items())
    return (f"  torch.compile: {c.frames_first_step} frames compiled in the first step, {c.frames_after} after it; "
            f"{c.graphs} graphs; graph breaks: {c.unit_breaks} at zero3 unit hooks, "
            f"{sum(c.other_breaks.values())} others" + (f" ({others})" if others else ""))


def _placement(bytes_: tuple[int, int, int], fmt: Any) -> str:
    return ", ".join(f"{name} {fmt(b)}" for name, b in zip(("device", "host", "disk"), bytes_))


def _summarize(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    held: tuple[int, ...],
    steps: list[StepRecord],
    unit: str,
) -> MonitorSummary:
    option = option_of(trainer.strategy)
    precision = str(trainer.precision)
    n = trainer.world_size
    group = _shard_group_size(trainer.strategy, n)
    num_params, trainable = _parameter_counts(pl_module)
    model = placement = None
    bucket_bytes = 0
    config = getattr(trainer.strategy, "config", None)
    plan = _subgroup_plan(trainer.strategy)
    if option in estimate.LAYOUTS and precision in estimate.PRECISIONS:
        bucket_mb = config.comm.bucket_mb if option.startswith("zero") else 0.0
        offload = getattr(config, "offload", None)
        if plan is not None:  # the sizes the run chose
            offload = dataclasses.replace(offload, offload_subgroup_mb=plan.subgroup_bytes / 2**20,
                                          offload_resident_subgroups=plan.resident)
        # Under hybrid sharding a rank holds what a flat run over its group would: see [Note: the monitor under
        # hybrid sharding].
        e = estimate.estimate(option, num_params, group or n, precision, bucket_mb, trainable, offload,
                              host_run=trainer.strategy.root_device.type == "cpu")
        model, bucket_bytes = (e.params, e.grads, e.optimizer), e.buckets
        placement = (e.device - e.buckets, e.host, e.disk)  # model states only, as measured
    ddp = estimate.estimate("ddp", num_params, n, _DDP_PRECISION, 0.0, trainable)
    # The first step pays one-off costs (allocating optimizer states and buffers): time the later ones when any.
    timed = steps[1:] or steps
    comm = [s.comm_bytes for s in timed if s.comm_bytes is not None]
    cross = [s.cross_bytes for s in timed if s.cross_bytes is not None]
    element_bytes = next((p.element_size() for p in pl_module.parameters() if p.requires_grad), 4)
    ideal = ideal_cross = None
    if option in estimate.LAYOUTS and comm:
        zeropp = _zeropp_options(trainer.strategy)
        if group is None:
            ideal = estimate.communication_bytes(option, num_params, n, element_bytes, trainable, **zeropp)
        else:  # qgZ is refused under hybrid sharding
            inside, ideal_cross = estimate.hybrid_communication_bytes(
                option, num_params, n, group, element_bytes, trainable, zeropp["quantize_weights"],
                zeropp["hpz_group_size"])
            ideal = inside + ideal_cross
    return MonitorSummary(
        option=option,
        precision=precision,
        world_size=n,
        steps=len(steps),
        num_params=num_params,
        trainable_params=trainable,
        held=held[:3],
        predicted=model,
        bucket_bytes=bucket_bytes,
        ddp=(ddp.params, ddp.grads, ddp.optimizer),
        comm_bytes_per_step=int(statistics.median(comm)) if comm else None,
        ideal_comm_bytes_per_step=ideal,
        throughput=statistics.median(s.items * n / s.seconds for s in timed),
        throughput_unit=unit,
        steps_timed=len(timed),
        placement=held[3:],
        predicted_placement=placement,
        shard_group_size=group,
        cross_bytes_per_step=int(statistics.median(cross)) if cross else None,
        ideal_cross_bytes_per_step=ideal_cross,
        offload_subgroups=plan.describe() if plan is not None else None,
    )


def _subgroup_plan(strategy: pl.strategies.Strategy) -> SubgroupPlan | None:
    """Disk offload's sub-group sizes as the run chose them (offload/sizing.py), or None without disk offload."""
    config = getattr(strategy, "config", None)
    if not isinstance(config, ZeroConfig) or not config.offload.on_disk:
        return None
    return getattr(strategy.runtime.offload, "plan", None)


def _shard_group_size(strategy: pl.strategies.Strategy, world_size: int) -> int | None:
    """Hybrid sharding's group size when the strategy runs it (fewer ranks than the world), else ``None``."""
    config = getattr(strategy, "config", None)
    group = config.topology.shard_group_size if isinstance(config, ZeroConfig) else None
    if group == PER_NODE:
        group = strategy.topology().shard_group_size
    return group if group is not None and group < world_size else None


def _zeropp_options(strategy: pl.strategies.Strategy) -> dict[str, Any]:
    """The ZeRO++ options ``estimate.communication_bytes`` takes, as the strategy runs them (none for other
    strategies); ``node_size`` as the strategy's topology resolves it (qgZ's two stages)."""
    config = getattr(strategy, "config", None)
    if not isinstance(config, ZeroConfig):
        return dict(quantize_weights=False, hpz_group_size=None, quantize_grads=None, node_size=None)
    quantize_grads = config.comm.quantize_grads
    hpz = config.topology.hpz_group_size
    return dict(quantize_weights=config.stage3.quantize_weights,
                hpz_group_size=strategy.topology().hpz_group_size if hpz == PER_NODE else hpz,
                quantize_grads=quantize_grads, node_size=strategy.topology().node_size if quantize_grads else None)


def option_of(strategy: pl.strategies.Strategy) -> str | None:
    """The option of the memory model (``estimate.LAYOUTS``: ``"ddp"``, ``"zero2"``, ``"zero3_offload_disk"``...) a
    strategy runs, else ``None``."""
    config = getattr(strategy, "config", None)
    if isinstance(config, ZeroConfig):
        offload = config.offload
        name = estimate.option_name(config.stage, offload.offload_optimizer, offload.offload_params)
        if name is None:  # a combination the memory model has no option for: named by its settings
            name = (f"zero{config.stage} (offload_optimizer={offload.offload_optimizer}, "
                    f"offload_params={offload.offload_params})")
        return name
    if isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)):
        return "ddp"
    return None


def _parameter_counts(pl_module: pl.LightningModule) -> tuple[int, int]:
    """Unsharded counts: what the module recorded when it built its network, else what it holds now."""
    total = getattr(pl_module, "num_parameters", None)
    trainable = getattr(pl_module, "num_trainable_parameters", None)
    if total is None:
        params = list(pl_module.parameters())
        total = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
    return total, total if trainable is None else trainable


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


def _maybe(value: int | None, fmt: Any) -> str:
    return "n/a" if value is None else fmt(value)
