"""The memory model: model-state bytes per rank for DDP, ZeRO stages 1-3 and their offload options, by placement
(device, host memory, disk), and the least complex option that fits.

[Note: what the memory model counts]
Model states only, for Adam-like optimizers (two fp32 moments per element, K = 12 in the ZeRO paper), with Ψ parameters
on N data-parallel ranks:

* ``"32-true"``: 4 bytes of parameter, 4 of gradient and 8 of optimizer state (the moments) per element; there is no
  separate master copy. DDP 16Ψ, zero1 8Ψ + 8Ψ/N, zero2 4Ψ + 12Ψ/N, zero3 16Ψ/N.
* ``"bf16-mixed"`` / ``"16-mixed"``: 2 bytes of 16-bit working parameter, 2 of gradient and 12 of optimizer state (fp32
  master weights + moments). DDP 16Ψ, zero1 4Ψ + 12Ψ/N, zero2 2Ψ + 14Ψ/N, zero3 16Ψ/N.

Stage s shards the kinds stage s adds: zero1 the optimizer state, zero2 also the gradients, zero3 also the parameters.
A sharded kind costs ceil(elements / N) elements on the rank that owns the largest shard (the per-parameter
padding of a dim-0 split, at most N-1 rows per parameter, is not modelled). Frozen parameters
(``trainable_params < num_params``) hold a parameter but no gradient and no optimizer state.

On top of the model states a ZeRO option holds one communication bucket of ``bucket_mb`` MiB (ZeroConfig.bucket_mb
bounds the flat buffers a step packs into), or of the size of all parameters when they are fewer. DDP's own gradient
buckets are not counted, as in the ZeRO paper's 16Ψ. Activations, the one unit that zero3 gathers at a time, the CUDA
context and allocator fragmentation are not modelled: leave headroom for them in the budget.

[Note: offload in the memory model]
An offload option (``LAYOUTS``) keeps the optimizer state, always 12 bytes per element there (a separate fp32 master,
in fp32 runs too, and the two moments), in host memory (``_offload``) or in files (``_offload_disk``), and under
stage 3 possibly the parameter shards too (``zero3_offload_params``: host; ``zero3_offload_disk``: disk). ZeRO-Offload
stage 2 in 16-bit: 2Ψ + 2Ψ/N on the device, 12Ψ/N on the host. Besides the states, offload holds host buffers
(``MemoryEstimate.host_buffers``): one staging copy of the gradient shards (w Ψ_t/N, w the working bytes) and, when
the working parameters stay on the device, one of the updated rows (w Ψ_t/N) (pinned on CUDA; a run whose training
device is the host, ``host_run``, holds neither, its gradients being in host memory already); disk offload adds the
sub-groups it keeps resident (``offload_resident_subgroups`` x ``offload_subgroup_mb`` of fp32 masters, with their
moments and parameter rows: 12 (+ w) bytes per 4 of master), at most everything it has on disk, sized from the
rank's host budget when the options leave them open (offload/sizing.py, [Note: sizing disk offload's sub-groups]).
In a host run, disk offload of stage 2 or 3 also keeps the gradient shards in files, and reads them with their
sub-group (w more bytes per 4 of master). ``recommend`` checks the device budget against the device bytes and
buckets, the host budget against the host states and buffers, the disk budget against the files; a budget whose
device is host memory (``Budget.shared_host``) is a host run's.

[Note: the peak of a run]
What a rank holds at its peak is more than its model states, and a run meets its peak in one of its phases
(``PHASES``): building the model, the strategy's setup, the steps, a checkpoint save, the teardown, a resume.
``peak_estimate`` adds, phase by phase, to the model states that live in memory (``estimate``; disk offload's files
only through the sub-groups it keeps resident):

* the baseline: what the process holds before its model exists (the interpreter, torch, Lightning; on a CPU run
  about 0.3 GiB), measured (``step_measure.StepMeasure``); 0 on CUDA, whose context is outside the allocator;
* the eager model: the full model as built (4Ψ in fp32), until setup has sharded it (stage 3) or as the parameters
  themselves (DDP, stages 1-2); stage 3 under ``configure_model`` materializes one unit at a time instead;
* the communication buckets (``bucket_mb``), and under stage 3 the gathered units in flight: the root unit (gathered
  for the whole step), the unit computing and ``prefetch`` more, and one unit of full gradients being reduced;
* under stage 3, the backward's reductions (``reductions``): the rank-major buffers of the ``MAX_IN_FLIGHT`` unit
  reductions pending and of the next one being packed (the pool keeps that one on a host; the caching allocator on
  CUDA), and the segments each pending reduction receives (gloo's exchange on a host: (N-1)/N of a unit; NCCL's
  output: 1/N). With U the largest unit, N ranks and ``MAX_IN_FLIGHT`` = 2: 3U + 2U(N-1)/N on a host;
* the activations at the run's micro-batch, measured on one real step at two tiny batches and scaled;
* the optimizer step's workspace: torch's foreach Adam makes one fp32 temporary per element it updates (the square
  root of the second moment: 4Ψ/N under ZeRO, 4Ψ under DDP); offload steps one group of ``bucket_mb`` at a time.

[Note: where stage 3's step peaks]
Stage 3's step meets its peak in one of two moments, not in both: in the backward, where the activations not yet
consumed, the units in flight and the reductions pending are held (counted on the 85M GPT of BENCHMARKS.md, 2 CPU
ranks: one unit's full parameters, its full gradients, a prefetch's gather buffer, the pool's free buffer, two
pending reductions' buffers and received segments, 7 units' bytes in all); or in the optimizer step, when those are
freed and the workspace is allocated. So its step is the states, buckets and gathered units plus the larger of the
backward's (activations and reductions) and the update's (workspace). Summed instead, the workspace of in-memory
zero3 (4Ψ/N) hid the backward's reductions, and host offload, whose workspace is one group, measured 1.15x the sum
without them (zero3_offload's steady step, BENCHMARKS.md). Stages 1 and 2 keep the sum: their reductions are
bounded by ``bucket_mb``, and their full gradients (stage 1) or the last buckets' (stage 2) are held into the step.

Setup adds to the eager model what it allocates: DDP its gradient buckets, stage 3 the parameter shards and one
unit, offload the fp32 masters. Memory freed after a step stays with the process (glibc's heap on a CPU, the
caching allocator on CUDA), so a checkpoint save and the teardown start from the step's peak; stage 3's teardown
gathers the full model back into the module (4Ψ; with parameter shards on disk into memory-mapped files, whose pages
are not held). On a CPU device stage 3 and the offloads hand freed blocks back at once ([Note: glibc's heap and a
memory limit]), so their teardown holds the states, the full model and the gathers that rebuild it. A resumed job
peaks at the larger of its setup and its step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lightning_zero import config
from lightning_zero.offload.sizing import SubgroupPlan, per_master_byte, plan_subgroups
from lightning_zero.sharding.in_flight import MAX_IN_FLIGHT
from lightning_zero.sharding.quantize import DEFAULT_BLOCK_SIZE, INTRA_NODE_BITS, BlockFormat
from lightning_zero.step_measure import StepMeasure


@dataclass(frozen=True)
class Layout:
    """What an option shards (``stage``; 0: DDP) and where it offloads (``config.OffloadConfig``'s values)."""

    stage: int
    offload_optimizer: str | None = None
    offload_params: str | None = None

    def strategy_options(self) -> dict[str, object]:
        """``ZeroStrategy`` keyword arguments of a ZeRO option."""
        options: dict[str, object] = {"stage": self.stage}
        if self.offload_optimizer is not None:
            options["offload_optimizer"] = self.offload_optimizer
        if self.offload_params is not None:
            options["offload_params"] = self.offload_params
        return options


def how_to_select(option: str, registered: frozenset[str]) -> str:
    """How a user picks ``option``: by its name where a strategy of that name is registered (``registered``),
    otherwise by the stage and offload settings it stands for, on the command line and in Python."""
    if option in registered:
        return f'strategy={option} on the command line, Trainer(strategy="{option}") in Python'
    options = LAYOUTS[option].strategy_options()
    cli = " ".join([f"strategy=zero{options['stage']}"] + [f"strategy.{k}={v}" for k, v in options.items() if k != "stage"])
    python = ", ".join(f"{k}={v!r}" for k, v in options.items())
    return f"{cli} on the command line, Trainer(strategy=ZeroStrategy({python})) in Python"


#: Every option, least complex first within each tier: in-device, then host offload, then disk offload.
LAYOUTS: dict[str, Layout] = {
    "ddp": Layout(0),
    "zero1": Layout(1),
    "zero2": Layout(2),
    "zero3": Layout(3),
    "zero1_offload": Layout(1, "cpu"),
    "zero2_offload": Layout(2, "cpu"),
    "zero3_offload": Layout(3, "cpu"),
    "zero3_offload_params": Layout(3, "cpu", "cpu"),
    "zero1_offload_disk": Layout(1, "disk"),
    "zero2_offload_disk": Layout(2, "disk"),
    "zero3_offload_disk": Layout(3, "disk", "disk"),
}
#: The options in order of complexity; ``recommend`` returns the first that fits.
OPTIONS = tuple(LAYOUTS)
#: The options that keep every model state on the device.
IN_DEVICE_OPTIONS = tuple(o for o, layout in LAYOUTS.items() if layout.offload_optimizer is None)
#: The precision flags ZeroStrategy supports (``config.PRECISIONS``), each modelled from its working dtype.
PRECISIONS = tuple(config.PRECISIONS)


def option_name(stage: int, offload_optimizer: str | None = None, offload_params: str | None = None) -> str | None:
    """The option of ``LAYOUTS`` with these settings (``stage`` 0: DDP), or None if the model has none."""
    wanted = Layout(stage, offload_optimizer, offload_params)
    return next((name for name, layout in LAYOUTS.items() if layout == wanted), None)


class EstimateError(ValueError):
    """An input to the memory model is invalid; the message names the field and the allowed values."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds for one option (the rank with the largest shard when a kind does not divide evenly).

    ``params``, ``grads`` and ``optimizer`` count each kind wherever it lives; ``host`` and ``disk`` say how many of
    those bytes live in host memory and in files (see [Note: offload in the memory model]).
    """

    option: str
    ranks: int
    params: int
    grads: int
    optimizer: int
    buckets: int
    host: int = 0
    disk: int = 0
    #: Host memory offload needs besides the states: staging buffers, disk offload's resident sub-groups.
    host_buffers: int = 0
    #: What the run's peak holds beyond the model states and buckets (``with_peak``: the process baseline,
    #: activations, gathered units, the optimizer's workspace, the eager model); 0 when no step was measured.
    workspace: int = 0
    #: Disk offload: its sub-groups' size and resident count, given or chosen (``host_buffers`` counts them).
    subgroups: SubgroupPlan | None = None

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """Model states wherever they live, and the buckets."""
        return self.model_states + self.buckets

    @property
    def device(self) -> int:
        """What the training device holds at the peak: the model states not offloaded, the buckets and, once a step
        was measured (``with_peak``), everything else the peak holds."""
        return self.total - self.host - self.disk + self.workspace

    @property
    def host_total(self) -> int:
        """What host memory holds for the model states: the offloaded states and the offload's buffers."""
        return self.host + self.host_buffers


@dataclass(frozen=True)
class Budget:
    """Bytes one rank may use on its device, in host memory and on disk (None: that placement is not offered, so the
    options that need it are not considered).

    ``shared_host``: the device is host memory (a CPU run), so the device and host bytes of an option count against
    ``device`` together: host offload cannot lower such a run's memory, disk offload can.
    """

    device: int
    host: int | None = None
    disk: int | None = None
    shared_host: bool = False

    def __post_init__(self) -> None:
        for name in ("device", "host", "disk"):
            value = getattr(self, name)
            if value is None and name != "device":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                field = "budget_bytes" if name == "device" else f"{name}_budget_bytes"
                raise EstimateError(f"{field}={value!r} is invalid: it must be > 0")

    def offers(self, e: MemoryEstimate) -> bool:
        """Whether every placement ``e`` needs has a budget."""
        needs_host = e.host_total > 0 and not self.shared_host
        return not (needs_host and self.host is None or e.disk > 0 and self.disk is None)

    def fits(self, e: MemoryEstimate) -> bool:
        on_device = e.device + (e.host_total if self.shared_host else 0)
        if not self.offers(e) or on_device > self.device:
            return False
        host_ok = self.shared_host or e.host_total == 0 or e.host_total <= self.host
        return host_ok and (e.disk == 0 or e.disk <= self.disk)

    def describe(self, e: MemoryEstimate) -> str:
        """``e``'s bytes against this budget, placement by placement."""
        fmt = format_bytes
        if self.shared_host and e.host_total:
            parts = [f"{fmt(e.device + e.host_total)} of {fmt(self.device)} of memory (device and host are one)"]
        else:
            parts = [f"{fmt(e.device)} of {fmt(self.device)} on the device"]
            if e.host_total:
                parts.append(f"{fmt(e.host_total)} of {fmt(self.host)} of host memory")
        if e.disk:
            parts.append(f"{fmt(e.disk)} of {fmt(self.disk)} on disk")
        return ", ".join(parts) + " per rank"


@dataclass(frozen=True)
class Recommendation:
    """The least complex option whose estimate fits the per-rank budget, or ``choice=None`` when none does."""

    choice: str | None
    budget: Budget
    estimates: tuple[MemoryEstimate, ...]
    #: When nothing fits: the fewest ranks at which the most sharded option considered would fit (None if no number
    #: of ranks would, because the unsharded part alone exceeds the budget). None when something fits.
    min_ranks: int | None = None

    @property
    def budget_bytes(self) -> int:
        return self.budget.device

    def explain(self) -> str:
        considered = [e for e in self.estimates if self.budget.offers(e)]
        if self.choice is not None:
            chosen = next(e for e in self.estimates if e.option == self.choice)
            if chosen.option in IN_DEVICE_OPTIONS:
                return (
                    f"{self.choice}: the least complex option that fits ({format_bytes(chosen.device)} of "
                    f"{format_bytes(self.budget.device)} per rank)"
                )
            return f"{self.choice}: the least complex option that fits ({self.budget.describe(chosen)}); " + _why_not(
                considered[: considered.index(chosen)], self.budget, chosen.option
            )
        most_sharded = considered[-1]
        ranks = f"{most_sharded.ranks} rank" + ("s" if most_sharded.ranks != 1 else "")
        if most_sharded.option in IN_DEVICE_OPTIONS:
            line = (
                f"nothing fits: {most_sharded.option} needs {format_bytes(most_sharded.device)} per rank on {ranks}, "
                f"the budget is {format_bytes(self.budget.device)}"
            )
        else:
            line = f"nothing fits: {most_sharded.option} needs {self.budget.describe(most_sharded)} on {ranks}"
        if self.min_ranks is None:
            return line + "; no number of ranks fits, because its unsharded part alone exceeds the budget"
        return line + f"; {most_sharded.option} fits on {self.min_ranks} ranks or more"


def _why_not(rejected: list[MemoryEstimate], budget: Budget, chosen: str) -> str:
    """Why the less complex tiers were passed over (no offload, host, disk), each by its most sharded option."""
    tiers: dict[str | None, MemoryEstimate] = {}
    for e in rejected:
        tiers[LAYOUTS[e.option].offload_optimizer] = e
    tiers.pop(LAYOUTS[chosen].offload_optimizer, None)
    tiers = {"no offload" if tier is None else tier: e for tier, e in tiers.items()}
    names = {"no offload": "without offload", "cpu": "with host offload", "disk": "with disk offload"}
    return "; ".join(
        f"nothing {names[tier]} fits ({e.option} needs {budget.describe(e)})" for tier, e in tiers.items()
    )


def estimate(
    option: str,
    num_params: int,
    ranks: int,
    precision: str = "32-true",
    bucket_mb: float = 25.0,
    trainable_params: int | None = None,
    offload: config.OffloadConfig | None = None,
    host_run: bool = False,
    host_budget: int | None = None,
) -> MemoryEstimate:
    """Model-state bytes per rank for ``option`` (see [Note: what the memory model counts] and [Note: offload in the
    memory model]); ``offload`` gives disk offload's sub-group settings (default: ``OffloadConfig()``'s, chosen from
    ``host_budget``, the rank's host memory, when known); ``host_run``: the training device is the host (a CPU run),
    which stages nothing and where disk offload keeps the gradient shards in files too."""
    _check_choice("option", option, OPTIONS)
    _check_choice("precision", precision, PRECISIONS)
    trainable = _check_counts(num_params, ranks, trainable_params)
    if not 0 <= bucket_mb < math.inf:
        raise EstimateError(f"bucket_mb={bucket_mb!r} is invalid: it must be a finite number of MiB >= 0")
    layout = LAYOUTS[option]
    param_b, grad_b, optim_b = _bytes_per_element(precision)
    if layout.offload_optimizer is not None:
        optim_b = 12  # a separate fp32 master, in fp32 runs too, and the two moments
    param_elements = _elements_per_rank(num_params, ranks, layout.stage >= 3)
    grad_elements = _elements_per_rank(trainable, ranks, layout.stage >= 2)
    optim_elements = _elements_per_rank(trainable, ranks, layout.stage >= 1)
    params, optimizer = param_b * param_elements, optim_b * optim_elements
    grads = grad_b * grad_elements
    placed = {"cpu": 0, "disk": 0, None: 0}
    placed[layout.offload_optimizer] += optimizer
    placed[layout.offload_params] += params
    if host_run and layout.offload_optimizer == "disk" and layout.stage >= 2:
        placed["disk"] += grads  # gradient shards in files, read back with their sub-group
    return MemoryEstimate(
        option=option,
        ranks=ranks,
        params=params,
        grads=grads,
        optimizer=optimizer,
        buckets=0 if option == "ddp" else min(int(bucket_mb * 2**20), param_b * num_params),
        host=placed["cpu"],
        disk=placed["disk"],
        **_host_buffers(layout, param_b, optim_elements, offload or config.OffloadConfig(), host_run, host_budget),
    )


def _host_buffers(layout: Layout, working: int, elements: int, offload: config.OffloadConfig, host_run: bool,
                  host_budget: int | None) -> dict:
    """Offload's staging copies and disk offload's resident sub-groups, and their plan (see [Note: offload in the
    memory model])."""
    if layout.offload_optimizer is None:
        return {}
    staging = 0 if host_run else working * elements * (1 if layout.offload_params is not None else 2)
    if layout.offload_optimizer != "disk":
        return {"host_buffers": staging}
    rows = working if layout.offload_params == "disk" else 0
    grads = working if host_run and layout.stage >= 2 else 0  # gradient shards in files, read with their sub-group
    per_byte = per_master_byte(rows, grads)
    plan = plan_subgroups(offload, 4 * elements, per_byte, host_budget)
    return {"host_buffers": staging + plan.buffer_bytes(per_byte, masters_bytes=4 * elements), "subgroups": plan}


def estimate_all(
    num_params: int,
    ranks: int,
    precision: str = "32-true",
    bucket_mb: float = 25.0,
    trainable_params: int | None = None,
    options: tuple[str, ...] = OPTIONS,
    offload: config.OffloadConfig | None = None,
    host_run: bool = False,
    host_budget: int | None = None,
) -> tuple[MemoryEstimate, ...]:
    return tuple(estimate(o, num_params, ranks, precision, bucket_mb, trainable_params, offload, host_run, host_budget)
                 for o in options)


def recommend(
    num_params: int,
    ranks: int,
    budget: int | Budget,
    precision: str = "32-true",
    bucket_mb: float = 25.0,
    trainable_params: int | None = None,
    options: tuple[str, ...] = OPTIONS,
    offload: config.OffloadConfig | None = None,
    peak: PeakInputs | None = None,
) -> Recommendation:
    """The first of ``options`` (least complex first: ddp < zero1 < zero2 < zero3, then host offload, then disk
    offload) whose bytes fit ``budget``: a ``Budget``, or the device bytes alone (no offload considered).

    ``options`` restricts the choice, e.g. to the stages implemented in this release. An option is considered only
    when every placement it needs has a budget (``Budget.offers``). With ``peak`` (a measured step), an option's
    device bytes are its whole peak per rank (``peak_estimate``), not its model states alone.
    """
    if not options:
        raise EstimateError(f"options=() is invalid: name at least one of {', '.join(OPTIONS)}")
    if not isinstance(budget, Budget):
        budget = Budget(budget)
    ordered = tuple(o for o in OPTIONS if o in options)

    host_budget = budget.device if budget.shared_host else budget.host

    def estimate_at(option: str, n: int) -> MemoryEstimate:
        e = estimate(option, num_params, n, precision, bucket_mb, trainable_params, offload, budget.shared_host,
                     host_budget)
        if peak is None:
            return e
        return with_peak(e, peak_estimate(option, num_params, n, peak.measure, peak.batch, precision, bucket_mb,
                                          trainable_params, offload, peak.eager, shared_host=budget.shared_host,
                                          host_budget=host_budget))

    estimates = tuple(estimate_at(o, ranks) for o in ordered)
    for e in estimates:
        if budget.fits(e):
            return Recommendation(e.option, budget, estimates)
    considered = [e for e in estimates if budget.offers(e)]
    if not considered:
        raise EstimateError(
            f"options={options!r} is invalid for this budget: each needs host memory or disk, and the budget offers "
            "neither"
        )

    def fits_at(n: int) -> bool:
        return budget.fits(estimate_at(considered[-1].option, n))

    return Recommendation(None, budget, estimates, _min_ranks_to_fit(fits_at, ranks))


#: The phases of a run whose peak memory ``peak_estimate`` predicts (benchmarks/memory_phases.py measures the same).
PHASES = ("import_build", "setup", "first_step", "steady_step", "checkpoint_save", "teardown", "load_resume")


@dataclass(frozen=True)
class PeakEstimate:
    """The memory one rank reaches in each phase of a run (see [Note: the peak of a run]), and the model states of
    ``states`` it is built on. On a CPU run every byte is host memory; on CUDA ``phases`` is the device's."""

    states: MemoryEstimate
    phases: dict[str, int]
    #: The terms of the formula: baseline, eager model, states in memory, buckets, gathered units, stage 3's
    #: reductions in flight, activations, the optimizer step's workspace.
    terms: dict[str, int]
    #: Whether the device is host memory (a CPU run): ``phases`` then counts the host's bytes too.
    shared_host: bool = True

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)


def peak_estimate(
    option: str,
    num_params: int,
    ranks: int,
    measure: StepMeasure,
    batch: int,
    precision: str = "32-true",
    bucket_mb: float = 25.0,
    trainable_params: int | None = None,
    offload: config.OffloadConfig | None = None,
    eager: bool = True,
    prefetch: int = 1,
    shared_host: bool = True,
    hpz_group_size: int | None = None,
    host_budget: int | None = None,
) -> PeakEstimate:
    """The peak memory per rank in each phase of a run of ``option`` (see [Note: the peak of a run]): ``measure``
    is one measured step of the model (``step_measure.measure_step``), ``batch`` the sequences per rank and step,
    ``eager`` whether the model is built in full before setup (in ``__init__``; stage 3 under ``configure_model``
    materializes shards only), ``shared_host`` whether the device is host memory (a CPU run), ``host_budget`` the
    rank's host memory disk offload sizes its sub-groups from (when ``offload`` leaves them open), ``hpz_group_size``
    zero3's hpZ: its secondary shards, ``b / K2`` of every unit's elements (the root unit's measured apart keeps
    none), held from the forward to the backward, are part of the step."""
    e = estimate(option, num_params, ranks, precision, bucket_mb, trainable_params, offload, shared_host, host_budget)
    layout = LAYOUTS[option]
    trainable = _check_counts(num_params, ranks, trainable_params)
    optim_elements = _elements_per_rank(trainable, ranks, layout.stage >= 1)
    working = _bytes_per_element(precision)[0]
    in_memory = e.model_states - e.disk + e.host_buffers if shared_host else e.device - e.buckets
    unit = measure.unit_elements * working
    received = unit * (ranks - 1) // ranks if shared_host else -(-unit // ranks)
    terms = {
        "baseline": measure.baseline if shared_host else 0,
        "eager": num_params * measure.element_bytes if eager or layout.stage < 3 else unit,
        "states": in_memory,
        "buckets": e.buckets,
        "units": (measure.root_unit_elements * working + (prefetch + 2) * unit) if layout.stage == 3 else 0,
        "reductions": (MAX_IN_FLIGHT + 1) * unit + MAX_IN_FLIGHT * received if layout.stage == 3 else 0,
        "activations": measure.activations(batch),
        "workspace": 4 * optim_elements if layout.offload_optimizer is None else
        min(e.buckets, 4 * optim_elements) if shared_host else 0,
    }
    if hpz_group_size is not None:
        unit_elements = num_params - measure.root_unit_elements if layout.stage == 3 else 0
        terms["secondaries"] = unit_elements * working // hpz_group_size
    t = terms
    held = t["baseline"] + t["states"] + t["buckets"] + t["units"] + t.get("secondaries", 0)
    if layout.stage == 3:  # see [Note: where stage 3's step peaks]
        step = held + max(t["activations"] + t["reductions"], t["workspace"])
    else:
        step = held + t["activations"] + t["workspace"]
    made_at_setup = {0: e.grads, 3: (0 if layout.offload_params == "disk" else e.params) + unit}
    masters = 4 * optim_elements if layout.offload_optimizer is not None else 0
    setup = t["baseline"] + t["eager"] + made_at_setup.get(layout.stage, 0) + masters
    # the end of fit gives stage 3's module its full parameters: in memory, or memory-mapped files with parameter
    # shards on disk (DiskOffload.full_parameter), whose pages are not held
    full_model = num_params * measure.element_bytes if layout.stage == 3 and layout.offload_params != "disk" else 0
    if shared_host and (layout.stage == 3 or layout.offload_optimizer is not None):
        # on a CPU device these modes hand freed blocks back at once (memory.return_large_blocks_at_once): the end of
        # fit holds the states, the full model and the gathers that rebuild it, not the step's transients
        teardown = t["baseline"] + t["states"] + full_model + t["units"] + t["buckets"]
    else:
        teardown = step + full_model
    phases = {
        "import_build": t["baseline"] + t["eager"],
        "setup": setup,
        "first_step": step,
        "steady_step": step,
        "checkpoint_save": step,
        "teardown": teardown,
        "load_resume": max(setup, step),
    }
    return PeakEstimate(e, phases, terms, shared_host)


@dataclass(frozen=True)
class PeakInputs:
    """What ``peak_estimate`` needs beyond the model-state inputs: the measured step, the sequences per rank and
    step, whether the model is built eagerly."""

    measure: StepMeasure
    batch: int
    eager: bool = False


def with_peak(e: MemoryEstimate, peak: PeakEstimate) -> MemoryEstimate:
    """``e`` with its ``workspace`` set so that its device bytes (with its host bytes, where the device is host
    memory and ``peak`` counted both) are ``peak``'s peak."""
    counted = e.device + (e.host_total if peak.shared_host else 0)
    return replace(e, workspace=max(0, peak.peak - counted))


def communication_bytes(
    option: str, num_params: int, ranks: int, element_bytes: int, trainable_params: int | None = None,
    quantize_weights: bool = False, hpz_group_size: int | None = None, quantize_grads: str | None = None,
    node_size: int | None = None,
) -> int:
    """Ring-equivalent bytes one rank moves per optimizer step, with no overhead.

    DDP all-reduces the gradients (2 Ψ_t (N-1)/N elements); zero1 and zero2 reduce-scatter the gradients and
    all-gather the updated parameters (the same 2 Ψ_t (N-1)/N); zero3 all-gathers every parameter twice (forward and
    backward) and reduce-scatters the gradients: (2 Ψ + Ψ_t)(N-1)/N. Ψ_t counts trainable parameters: frozen ones
    are never reduced nor re-gathered after a step. ZeRO++'s options change one term each:

    - ``quantize_weights`` (zero3's qwZ): the all-gathers move int8 codes and one fp32 scale per block of 4096,
      about ``1 + 4/4096`` bytes per element instead of ``element_bytes`` (blocks restart at each parameter: a
      little more for many small parameters);
    - ``hpz_group_size=K2`` (zero3's hpZ): the backward all-gather runs inside groups of ``K2``, Ψ (K2-1)/K2, in
      full precision (from the secondary shards, which hold what the forward computed with);
    - ``quantize_grads`` (``"int4"``/``"int8"``, qgZ): the reduce-scatter is the two-stage exchange of
      ``quantized_reduce_bytes`` over nodes of ``node_size`` ranks (default: one node of all ``ranks``).
    """
    _check_choice("option", option, OPTIONS)
    trainable = _check_counts(num_params, ranks, trainable_params)
    ring, apart = 0, 0  # bytes of the collectives over all ranks; of those that run otherwise
    if quantize_grads is None:
        ring += trainable * element_bytes
    else:
        _check_choice("quantize_grads", quantize_grads, ("int4", "int8"))
        apart += sum(quantized_reduce_bytes(trainable, ranks, node_size or ranks, int(quantize_grads[3:])))
    if LAYOUTS[option].stage != 3:
        ring += trainable * element_bytes  # the all-gather of the updated parameters
    else:
        gather = (num_params + 4 * -(-num_params // DEFAULT_BLOCK_SIZE) if quantize_weights
                  else num_params * element_bytes)
        ring += gather
        if hpz_group_size is None:
            ring += gather
        else:
            apart += num_params * element_bytes * (hpz_group_size - 1) // hpz_group_size
    return ring * (ranks - 1) // ranks + apart


def hybrid_communication_bytes(
    option: str, num_params: int, ranks: int, shard_group_size: int, element_bytes: int,
    trainable_params: int | None = None, quantize_weights: bool = False, hpz_group_size: int | None = None,
) -> tuple[int, int]:
    """Ring-equivalent bytes one rank moves per optimizer step under hybrid sharding, ``(inside its shard group,
    to the other groups)`` (see [Note: hybrid sharding] in sharding/topology.py): inside, the stage's collectives over
    the ``K = shard_group_size`` ranks of its group (``communication_bytes`` at ``K`` ranks); across, the all-reduce of
    its gradient shard over the ``R = N / K`` replicas, ``2 (Ψ_t / K)(R - 1)/R`` elements. With one group per node the
    second is all that crosses nodes. Offload moves the same bytes: the host steps the shard the collectives left."""
    _check_choice("option", option, tuple(o for o in OPTIONS if LAYOUTS[o].stage >= 1))
    trainable = _check_counts(num_params, ranks, trainable_params)
    if shard_group_size < 1 or ranks % shard_group_size:
        raise EstimateError(
            f"shard_group_size={shard_group_size} is invalid for {ranks} ranks: it must divide the number of ranks"
        )
    inside = communication_bytes(option, num_params, shard_group_size, element_bytes, trainable_params,
                                 quantize_weights, hpz_group_size)
    replicas = ranks // shard_group_size
    return inside, 2 * trainable * element_bytes * (replicas - 1) // (shard_group_size * replicas)


def hpz_bytes(num_params: int, precision: str, hpz_group_size: int) -> int:
    """hpZ's secondary shards (``ZeroStrategy(hpz_group_size=K2)``, see [Note: hpZ's secondary shards] in
    sharding/unit_state.py): at the end of a forward each rank holds ``1/K2`` of every unit's gathered working-dtype
    weights, ``b Ψ / K2`` bytes (``b`` the working dtype's bytes), until each unit's backward gather. An upper bound
    by the root unit's parameters, which keep no secondary, and below it by the dim-0 padding (at most ``N - 1`` rows
    per parameter)."""
    _check_choice("precision", precision, PRECISIONS)
    _check_counts(num_params, 1, None)
    if isinstance(hpz_group_size, bool) or not isinstance(hpz_group_size, int) or hpz_group_size < 1:
        raise EstimateError(f"hpz_group_size={hpz_group_size!r} is invalid: it must be an integer >= 1")
    return working_bytes(precision) * -(-num_params // hpz_group_size)


def quantized_reduce_bytes(trainable_params: int, ranks: int, node_size: int, bits: int) -> tuple[int, int]:
    """qgZ (``quantize_grads``): the bytes one rank sends per step in the gradient reduce, ``(inside its node, across
    nodes)``, for ``ranks`` ranks in nodes of ``node_size``: its segment ``S = ceil(Ψ_t / N)`` is sent as block
    payloads (an fp32 scale per 4096 elements), ``(K - 1) G P8`` to the other members of its node as int8 and
    ``(G - 1) P`` across as ``bits`` 4 or 8 (quantized_collectives.py, [Note: the quantized reduce-scatter], [Note: qgZ's two
    formats]). Counted as one block run: blocks restart at each parameter, which adds at most a scale and 3 bytes of
    alignment per parameter to each payload."""
    trainable = _check_counts(trainable_params, ranks, None)
    if node_size < 1 or ranks % node_size:
        raise EstimateError(f"node_size={node_size} is invalid for {ranks} ranks: it must divide the number of ranks")
    if bits not in (4, 8):
        raise EstimateError(f"bits={bits} is invalid: qgZ quantizes to 4 or 8 bits")
    segment = -(-trainable // ranks)
    nodes = ranks // node_size
    inside, across = (BlockFormat(bits=b).layout(segment).nbytes for b in (INTRA_NODE_BITS, bits))
    return (node_size - 1) * nodes * inside, (nodes - 1) * across


def parse_count(text: str) -> int:
    """``"125M"``, ``"1.3B"``, ``"7e9"`` or ``"350000"`` -> a parameter count."""
    suffixes = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
    stripped = text.strip().upper()
    scale = suffixes.get(stripped[-1:], 1)
    number = stripped[:-1] if scale != 1 else stripped
    try:
        value = float(number) * scale
    except ValueError:
        raise EstimateError(
            f"params={text!r} is invalid: give a count like 350000, 125M, 1.3B or 7e9"
        ) from None
    if not value >= 1 or not math.isfinite(value):
        raise EstimateError(f"params={text!r} is invalid: it must be at least 1")
    return int(round(value))


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def working_bytes(precision: str) -> int:
    """Bytes of a working parameter (and of what the collectives move) at ``precision``."""
    _check_choice("precision", precision, PRECISIONS)
    return _bytes_per_element(precision)[0]


def _bytes_per_element(precision: str) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer state) bytes per element (see [Note: what the memory model counts])."""
    working = config.PRECISIONS[precision]
    if working is None:
        return 4, 4, 8  # one fp32 copy; the two Adam moments
    # 16-bit working parameters and gradients; fp32 master weights and the two moments in the optimizer state.
    return working.itemsize, working.itemsize, 12


def _elements_per_rank(elements: int, ranks: int, sharded: bool) -> int:
    return -(-elements // ranks) if sharded else elements


def _min_ranks_to_fit(fits_at, ranks: int) -> int | None:
    """The fewest ranks above ``ranks`` at which ``fits_at`` holds (bytes per rank only fall as ranks grow), or None
    if even 2^40 ranks would not do: the unsharded part alone exceeds the budget."""
    high = 2**40
    if not fits_at(high):
        return None
    low = ranks  # does not fit
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits_at(middle) else (middle, high)
    return high


def _check_choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise EstimateError(f"{field}={value!r} is invalid: allowed values are {', '.join(allowed)}")


def _check_counts(num_params: int, ranks: int, trainable_params: int | None) -> int:
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 1:
        raise EstimateError(f"num_params={num_params!r} is invalid: it must be an integer >= 1")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise EstimateError(f"ranks={ranks!r} is invalid: it must be an integer >= 1")
    if trainable_params is None:
        return num_params
    if not isinstance(trainable_params, int) or not 0 <= trainable_params <= num_params:
        raise EstimateError(
            f"trainable_params={trainable_params!r} is invalid: it must be an integer between 0 and num_params"
        )
    return trainable_params
