"""The memory model: model-state bytes per rank for DDP, ZeRO stages 1-3 and their offload options, by placement
(device, host memory, disk), and the least complex option that fits is chosen in recommend.py. estimate.py re-exports
it with the peak of a run (peak_model.py) and the bytes on the links (comm_model.py).

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_zero import config
from lightning_zero.estimate_options import (
    LAYOUTS,
    OPTIONS,
    PRECISIONS,
    EstimateError,
    Layout,
    _bytes_per_element,
    _check_choice,
    _check_counts,
    _elements_per_rank,
    format_bytes,
    working_bytes,
)
from lightning_zero.offload.sizing import SubgroupPlan, per_master_byte, plan_subgroups


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
