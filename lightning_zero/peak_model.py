"""The peak of a run: what one rank holds in each phase of a run (``PHASES``), from the memory model's states
(memory_model.py) and one measured step of the model (``step_measure.StepMeasure``).

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
without them (zero3_offload's steady step, BENCHMARKS.md). Disk offload's sub-group buffers are the update's too
(allocated for the step's update, freed after it): counted as held, they put zero3_offload_disk's predicted peak at
1.08-1.10x the measured one (tests/distributed/test_peak_estimate.py), 1.01x as the update's. Stages 1 and 2 keep the
sum: their reductions are bounded by ``bucket_mb``, and their full gradients (stage 1) or the last buckets' (stage 2)
are held into the step.

Setup adds to the eager model what it allocates: DDP its gradient buckets, stage 3 the parameter shards and one
unit, offload the fp32 masters. Memory freed after a step stays with the process (glibc's heap on a CPU, the
caching allocator on CUDA), so a checkpoint save and the teardown start from the step's peak; stage 3's teardown
gathers the full model back into the module (4Ψ; with parameter shards on disk into memory-mapped files, whose pages
are not held). On a CPU device stage 3 and the offloads hand freed blocks back at once ([Note: glibc's heap and a
memory limit]), so their teardown holds the states, the full model and the gathers that rebuild it. A resumed job
peaks at the larger of its setup and its step. The model is of a lean run ([Note: lean or fast memory] in
memory_policy.py), which every run whose model states are over an eighth of its budget is: a fast run keeps freed
blocks and buffers that this does not count, where its budget has room for them by that rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_zero import config
from lightning_zero.estimate_options import LAYOUTS, _bytes_per_element, _check_counts, _elements_per_rank
from lightning_zero.memory_model import MemoryEstimate, estimate
from lightning_zero.sharding.in_flight import MAX_IN_FLIGHT
from lightning_zero.step_measure import StepMeasure


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
    # disk offload's sub-group buffers exist during the update only (DiskOffload frees them between steps)
    update_only = e.host_buffers if shared_host and layout.offload_optimizer == "disk" else 0
    in_memory = e.model_states - e.disk + e.host_buffers - update_only if shared_host else e.device - e.buckets
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
        min(e.buckets, 4 * optim_elements) + update_only if shared_host else 0,
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
