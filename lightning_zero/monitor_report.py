"""What ZeroMonitor (monitor.py) reports: the records of a run's steps, the summary rank 0 makes of them at the end
of training, set against the memory and communication models of ``estimate.py`` (``_summarize``), and the report's
text (``format_report``); with the compile counters the report takes from Dynamo.

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

[Note: what the report says of torch.compile]
A compiled model's cost beyond its kernels is its graph breaks (each one leaves the graph, runs Python, enters the next
one) and its recompilations (each one traces and compiles a frame again). Dynamo counts both for the process
(``torch._dynamo.utils.counters``); the monitor takes the difference over ``fit`` and over its first training step:
frames compiled (in the first step, and after it: a frame compiled again is a recompilation, or a first evaluation's,
whose no-grad forward compiles its own), graphs, and the graph breaks found while tracing, by reason. Under zero3 a
unit's gather and reshard hooks are graph breaks by design (param_hooks.py, [Note: zero3 under torch.compile]): they
are counted apart from the others, which are the model's own (a logging call, data-dependent control flow).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lightning_zero import estimate
from lightning_zero.config import PER_NODE, ZeroConfig
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
    #: Whether the run held lean or fast between steps, and why (memory_policy.py, [Note: lean or fast memory]).
    memory_mode: str | None = None
    #: The ``mallopt`` settings the run made, by name (``None``: glibc's own): process-wide until teardown (memory.py,
    #: [Note: glibc's heap and a memory limit]).
    glibc_heap: dict[str, int] | None = None
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
    if s.memory_mode is not None:
        lines.append(f"  memory between steps: {s.memory_mode}")
    if s.glibc_heap:
        settings = ", ".join(f"{name}={value}" for name, value in s.glibc_heap.items())
        lines.append(f"  glibc's heap (mallopt, process-wide until teardown): {settings}")
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


def _maybe(value: int | None, fmt: Any) -> str:
    return "n/a" if value is None else fmt(value)
