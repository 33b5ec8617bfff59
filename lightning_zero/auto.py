"""``strategy=auto``: the least complex of ddp < zero1 < zero2 < zero3 whose model states fit the run's devices, then
the host offload options, then the disk offload ones.

The choice is ``estimate.recommend``'s (see [Note: what the memory model counts] and [Note: offload in the memory
model]) against a per-rank ``estimate.Budget``: on the device, on CUDA the free memory of the run's devices, on CPU
``AutoStrategy.budget_gb`` or by default the host budget, less ``reserve_gb`` either way; in host memory
``host_budget_gb``, by default the host budget: what the job may still take on this host, the smaller of
``MemAvailable`` and its memory cgroup's limit less its usage (host_memory.py, [Note: the host budget]), shared by the
node's ranks; on disk the free space of ``offload_dir`` shared by the node's ranks. On CPU the device is host memory,
so host offload cannot lower what a rank holds and only disk offload can help (``Budget.shared_host``). The reason
``choose`` gives names what bounds the host budget. Hydra builds ``AutoStrategy`` for ``strategy=auto``
(conf/strategy/auto.yaml); the command then calls ``choose`` and ``build``.

[Note: strategy=auto across ranks]
Ranks started by re-running the command (Lightning's ``popen`` launcher) would each measure free memory again and
could choose differently from the launching process, which would hang the first collective. So the launching process
chooses, and publishes its choice in the environment its ranks inherit (``shared_with_ranks``); ``choose`` in a rank
finds it there (``AUTO_ENV``) and takes it as it is.

[Note: strategy=auto between nodes]
With ``num_nodes > 1`` and the link's bandwidth given (``link_gbps``), the option that fits is then laid out between
the nodes by ``link_model.choose`` ([Note: the link model]): flat, hybrid sharding with one shard group a node (when
its model states, those of a world of one node, fit the budget) or ZeRO++'s options (qwZ, hpZ and int4 qgZ on zero3;
qgZ on zero1/zero2; with hpZ's secondary shards counted against the device budget), whichever makes the shortest
modelled step, the least complex on a near tie. The model needs the step's compute: ``step_s`` given, or measured
with ``measure: true`` (one thread, as the ranks run on a CPU). The settings travel to re-run ranks with the option.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from lightning_zero import estimate, link_model
from lightning_zero.config import SUPPORTED_STAGES
from lightning_zero.config_checks import first_line
from lightning_zero.host_memory import HostMemory, host_memory

if TYPE_CHECKING:
    from lightning_zero.models.language_model import ParameterCounts

#: The environment variable that carries the launching process's choice to re-run ranks.
AUTO_ENV = "LIGHTNING_ZERO_AUTO_STRATEGY"


class AutoStrategyError(ValueError):
    """``strategy=auto`` cannot choose; the message names the field or says what does not fit."""


@dataclass(frozen=True)
class AutoStrategy:
    """``strategy=auto``: the least complex option whose model states fit each device (``estimate.recommend``).

    Args:
        budget_gb: per-device budget in GiB when running on CPU; ``None``: the host budget per rank (the device is
            host memory). On CUDA the free memory of the run's devices is used.
        reserve_gb: GiB kept for activations and workspace, subtracted from the budget on CPU and CUDA alike.
        offload: also consider the offload options when nothing fits the device (host first, then disk).
        host_budget_gb: host memory per rank in GiB for host offload; ``None``: the host budget (the smaller of
            ``MemAvailable`` and the job's cgroup limit less its usage: host_memory.py) divided by the node's ranks.
        offload_dir: the directory disk offload would write into (its free space, divided by the node's ranks, is the
            disk budget), passed to the chosen strategy; ``None``: the system's temporary directory.
        bucket_mb, start_method: passed to the chosen strategy.
        measure: run one real step of the model on a tiny batch first (``step_measure.measure_step``) and choose from
            each option's whole peak per rank (``estimate.peak_estimate``: activations at the run's batch, gathered
            units, buckets, the optimizer's workspace and, on CPU, the process itself), not from its model states;
            it also times the step, for ``link_gbps``.
        link_gbps: the bandwidth between two nodes, Gbit/s each way: with ``num_nodes > 1``, choose between flat
            sharding, hybrid sharding and ZeRO++'s options by the link model (see [Note: strategy=auto between
            nodes]); ``None``: flat sharding, the link not considered.
        step_s: seconds a rank computes one step (forward and backward at the run's batch), for ``link_gbps``;
            ``None``: from the step ``measure`` times.
    """

    budget_gb: float | None = None
    reserve_gb: float = 0.0
    offload: bool = True
    host_budget_gb: float | None = None
    offload_dir: str | None = None
    bucket_mb: float = 25.0
    start_method: str = "popen"
    measure: bool = False
    link_gbps: float | None = None
    step_s: float | None = None

    def __post_init__(self) -> None:
        if self.budget_gb is not None:
            _check_amount("budget_gb", self.budget_gb, "GiB", zero_allowed=False)
        if self.link_gbps is not None:
            _check_amount("link_gbps", self.link_gbps, "Gbit/s", zero_allowed=False)
        if self.step_s is not None:
            _check_amount("step_s", self.step_s, "seconds", zero_allowed=False)
        _check_amount("reserve_gb", self.reserve_gb, "GiB", zero_allowed=True)
        if self.host_budget_gb is not None:
            _check_amount("host_budget_gb", self.host_budget_gb, "GiB", zero_allowed=False)
        _check_amount("bucket_mb", self.bucket_mb, "MiB", zero_allowed=False)
        for flag in ("offload", "measure"):
            if not isinstance(getattr(self, flag), bool):
                raise AutoStrategyError(f"{flag}={getattr(self, flag)!r} is invalid: it must be true or false")
        if self.offload_dir is not None and (not isinstance(self.offload_dir, str) or not self.offload_dir):
            raise AutoStrategyError(f"offload_dir={self.offload_dir!r} is invalid: it must be a directory path")


@dataclass(frozen=True)
class AutoChoice:
    """The option ``strategy=auto`` runs, and why (``reason`` is None when a re-run rank took it from its parent);
    ``settings``: the strategy options the link model added (see [Note: strategy=auto between nodes])."""

    option: str
    reason: str | None
    settings: tuple[tuple[str, object], ...] = ()

    def encode(self) -> str:
        """The choice as ``AUTO_ENV`` carries it: the option, then ``name=value`` per setting, space-separated."""
        return " ".join([self.option, *(f"{k}={v}" for k, v in self.settings)])

    @classmethod
    def decode(cls, text: str) -> AutoChoice:
        option, *pairs = text.split()
        return cls(option, None, tuple((k, _setting(v)) for k, v in (pair.split("=", 1) for pair in pairs)))


def choose(
    auto: AutoStrategy,
    counts: ParameterCounts | None,
    precision: str,
    accelerator: str = "auto",
    devices: Any = "auto",
    num_nodes: int = 1,
    step: estimate.PeakInputs | None = None,
) -> AutoChoice:
    """The option ``estimate.recommend`` picks for a model of ``counts`` parameters on the run's devices.

    ``accelerator``, ``devices`` and ``num_nodes`` are the run's ``Trainer`` arguments; ``step`` a measured step of
    the model (``measured_step``), to choose from each option's whole peak. A re-run rank takes the launching
    process's choice (see [Note: strategy=auto across ranks]).
    """
    inherited = os.environ.get(AUTO_ENV)
    if inherited is not None:
        return AutoChoice.decode(inherited)
    if counts is None:
        raise AutoStrategyError(
            "strategy=auto needs the model's parameter count: the model has no parameter_counts()"
        )
    if precision not in estimate.PRECISIONS:
        raise AutoStrategyError(
            f"trainer.precision={precision!r} is not supported by strategy=auto: "
            f"allowed values are {', '.join(estimate.PRECISIONS)}"
        )
    indexes = run_devices(accelerator, devices)
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise AutoStrategyError(f"trainer.num_nodes={num_nodes!r} is invalid: it must be an int > 0")
    host = host_memory()
    recommendation = estimate.recommend(
        counts.total,
        len(indexes) * num_nodes,
        rank_budget(auto, accelerator, indexes, host),
        precision,
        auto.bucket_mb,
        counts.trainable,
        options=available_options(auto.offload),
        peak=step,
    )
    reason = f"{recommendation.explain()}; host budget: {host.describe(len(indexes))}"
    if recommendation.choice is None:
        raise AutoStrategyError(f"strategy=auto: {reason}")
    choice = AutoChoice(recommendation.choice, reason)
    if auto.link_gbps is None or num_nodes == 1:
        return choice
    return between_nodes(auto, recommendation, counts, precision, len(indexes), num_nodes, step)


def between_nodes(
    auto: AutoStrategy, recommendation: estimate.Recommendation, counts: ParameterCounts, precision: str,
    per_node: int, num_nodes: int, step: estimate.PeakInputs | None,
) -> AutoChoice:
    """The recommended option, or a more sharded one of its tier that fits, laid out between the nodes by the link
    model (see [Note: strategy=auto between nodes])."""
    if auto.step_s is None and step is None:
        raise AutoStrategyError(
            "strategy.link_gbps needs the step's compute time: set strategy.measure=true (one step is timed) or "
            "strategy.step_s (seconds a rank computes one step)"
        )
    compute_s = auto.step_s if auto.step_s is not None else step.measure.compute_s(step.batch)
    ranks, budget, chosen = per_node * num_nodes, recommendation.budget, recommendation.choice
    tier = estimate.LAYOUTS[chosen].offload_optimizer
    candidates = [e.option for e in recommendation.estimates  # the choice, and the more sharded of its tier that fit
                  if estimate.LAYOUTS[e.option].offload_optimizer == tier and budget.fits(e)
                  and estimate.OPTIONS.index(e.option) >= estimate.OPTIONS.index(chosen)]
    options = [laid for option in candidates for laid in link_model.link_options(
        option, counts.total, counts.trainable, ranks, per_node, estimate.working_bytes(precision), auto.link_gbps,
        compute_s, tuple(k for k in link_model.KINDS if _fits(k, option, counts, precision, per_node, ranks, budget,
                                                              auto.bucket_mb, step)))]
    best = link_model.choose(options)
    why = "; ".join(o.describe() for o in options)
    return AutoChoice(best.option, f"{recommendation.explain()}; between {num_nodes} nodes at {auto.link_gbps:g} "
                      f"Gbit/s and {compute_s:.3g} s of compute a step, {best.option} {best.kind} makes the shortest "
                      f"step ({why})", best.settings)


def _fits(kind: str, option: str, counts: ParameterCounts, precision: str, per_node: int, ranks: int,
          budget: estimate.Budget, bucket_mb: float, step: estimate.PeakInputs | None) -> bool:
    """Whether ``option`` laid out as ``kind`` fits ``budget``: hybrid sharding holds what a world of one node holds;
    ZeRO++'s hpZ (zero3) adds its secondary shards (``estimate.hpz_bytes``; in a measured peak, ``peak_estimate``'s
    own count)."""
    zero3 = estimate.LAYOUTS[option].stage == 3
    if kind == "flat" or kind == "zero++" and not zero3:
        return True
    world = per_node if kind == "hybrid" else ranks
    hpz = per_node if kind == "zero++" else None
    e = estimate.estimate(option, counts.total, world, precision, bucket_mb, counts.trainable)
    if step is not None:
        peak = estimate.peak_estimate(option, counts.total, world, step.measure, step.batch, precision, bucket_mb,
                                      counts.trainable, eager=step.eager, shared_host=budget.shared_host,
                                      hpz_group_size=hpz)
        e = estimate.with_peak(e, peak)
    elif hpz is not None:
        e = replace(e, workspace=estimate.hpz_bytes(counts.total, precision, hpz))
    return budget.fits(e)


def measured_step(
    auto: AutoStrategy, model: Any, batch_size: int, seq_len: int, accelerator: str = "auto"
) -> estimate.PeakInputs | None:
    """With ``auto.measure``, one real step of ``model`` (a ``LanguageModel``: its ``model_config`` builds the
    network, built in ``configure_model``) on a tiny batch, and the run's sequences per rank and step; else, and in a
    re-run rank (which takes its parent's choice), None."""
    if not auto.measure or AUTO_ENV in os.environ:
        return None
    from lightning_zero.step_measure import measure_step

    config = getattr(model, "model_config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        raise AutoStrategyError(
            "strategy.measure=true needs a model whose model_config has a vocab_size (a LanguageModel's GPTConfig "
            "or HFModelConfig)"
        )
    device = "cuda:0" if _on_cuda(accelerator) else "cpu"
    return estimate.PeakInputs(measure_step(config, vocab, seq_len, device), batch_size, eager=False)


def build(option: str, auto: AutoStrategy, settings: tuple[tuple[str, object], ...] = ()) -> Any:
    """The Lightning strategy for a chosen option, with ``auto``'s bucket size, start method and offload directory,
    and the ``settings`` the link model added (``AutoChoice.settings``)."""
    if option == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(start_method=auto.start_method)
    from lightning_zero import ZeroStrategy

    options = estimate.LAYOUTS[option].strategy_options()
    if "disk" in options.values():
        options["offload_dir"] = auto.offload_dir
    return ZeroStrategy(**options, **dict(settings), bucket_mb=auto.bucket_mb, start_method=auto.start_method)


def available_options(offload: bool = True) -> tuple[str, ...]:
    """``ddp`` and the ZeRO stages, then (``offload``) their offload options, least complex first."""
    return tuple(
        name for name, layout in estimate.LAYOUTS.items()
        if (layout.stage == 0 or layout.stage in SUPPORTED_STAGES) and (offload or layout.offload_optimizer is None)
    )


@contextmanager
def shared_with_ranks(choice: AutoChoice | None) -> Iterator[None]:
    """Publish the launching process's choice to the ranks it starts (see [Note: strategy=auto across ranks])."""
    if choice is None or AUTO_ENV in os.environ:
        yield
        return
    os.environ[AUTO_ENV] = choice.encode()
    try:
        yield
    finally:
        del os.environ[AUTO_ENV]


def run_devices(accelerator: str, devices: Any) -> list[int]:
    """Indexes of the devices of one node the run will use, parsed as the ``Trainer`` parses ``devices``.

    A value the ``Trainer`` would refuse is refused here, with Lightning's reason, before anything is sized for it.
    """
    import torch
    from lightning.fabric.accelerators.cpu import _parse_cpu_cores
    from lightning.fabric.utilities.device_parser import _parse_gpu_ids

    on_cuda = _on_cuda(accelerator)
    count = (torch.cuda.device_count() if on_cuda else 1) if str(devices) == "auto" else devices
    try:
        indexes = _parse_gpu_ids(count, include_cuda=True) if on_cuda else list(range(_parse_cpu_cores(count)))
    except Exception as err:  # Lightning raises TypeError, ValueError or MisconfigurationException
        raise AutoStrategyError(f"trainer.devices={devices!r} is invalid: {first_line(err)}") from None
    if not indexes:
        raise AutoStrategyError(f"trainer.devices={devices!r} is invalid: it selects no device")
    return list(indexes)


def rank_budget(auto: AutoStrategy, accelerator: str, devices: list[int], host: HostMemory) -> estimate.Budget:
    """What one rank may hold on its device, in host memory and on disk (the last two only with ``auto.offload``);
    ``host`` is the job's host budget, shared by the node's ranks."""
    local_ranks = max(1, len(devices))
    device = device_budget(auto, accelerator, devices, host.per_rank(local_ranks))
    if not auto.offload:
        return estimate.Budget(device)
    host = int(auto.host_budget_gb * 2**30) if auto.host_budget_gb is not None else host.per_rank(local_ranks)
    where = auto.offload_dir if auto.offload_dir is not None else tempfile.gettempdir()
    try:
        disk = shutil.disk_usage(where).free // local_ranks
    except OSError:  # a directory that does not exist yet: disk offload is not offered (setup would refuse it)
        disk = None
    return estimate.Budget(device, max(1, host), disk or None, shared_host=not _on_cuda(accelerator))


def device_budget(auto: AutoStrategy, accelerator: str, devices: list[int], host_per_rank: int) -> int:
    """Bytes of model states one device may hold, less the reserve: the least free CUDA memory, or on CPU
    ``budget_gb`` or else ``host_per_rank``, the rank's share of the host budget."""
    if _on_cuda(accelerator):
        budget = min(cuda_free_bytes(d) for d in devices)
    else:
        budget = auto.budget_gb * 2**30 if auto.budget_gb is not None else host_per_rank
    budget -= auto.reserve_gb * 2**30
    if budget <= 0:
        raise AutoStrategyError(
            f"strategy.reserve_gb={auto.reserve_gb} is invalid: it leaves no memory for model states"
        )
    return int(budget)


def cuda_free_bytes(device: int) -> int:
    """Free memory of CUDA device ``device`` (numbered as the run sees its devices), read through NVML, which
    initializes no CUDA: this is the launching process, and Lightning cannot fork ranks (``start_method="fork"``, the
    ``_notebook`` strategies) from a process that initialized CUDA. torch's readings initialize it (device properties,
    ``mem_get_info``, and in torch 2.13 ``device_memory_used`` too, through its current device). Only without NVML
    (no NVIDIA driver library) is the CUDA runtime asked."""
    free = _nvml_free_bytes(device)
    if free is not None:
        return free
    import torch

    return torch.cuda.mem_get_info(device)[0]


class _NvmlMemory(ctypes.Structure):
    """NVML's ``nvmlMemory_t``: bytes of device memory."""

    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvml_free_bytes(device: int) -> int | None:
    """Free bytes of CUDA device ``device`` from the NVIDIA driver's NVML library, or None where it cannot tell."""
    import torch

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        index = torch.cuda._get_nvml_device_index(device)  # CUDA_VISIBLE_DEVICES applied, CUDA left alone
        handle, memory = ctypes.c_void_p(), _NvmlMemory()
        if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
            return None
        if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
            return None
        return int(memory.free)
    finally:
        nvml.nvmlShutdown()


def _on_cuda(accelerator: str) -> bool:
    import torch

    return accelerator in ("cuda", "gpu") or accelerator == "auto" and torch.cuda.is_available()


def _setting(text: str) -> object:
    """A setting's value as ``AutoChoice.encode`` wrote it: ``True``, an integer, or the text."""
    if text in ("True", "False"):
        return text == "True"
    return int(text) if text.isdigit() else text


def _check_amount(field: str, value: Any, unit: str, zero_allowed: bool) -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not is_number or value < 0 or value == 0 and not zero_allowed:
        bound = ">= 0" if zero_allowed else "> 0"
        raise AutoStrategyError(f"{field}={value!r} is invalid: it must be a finite number of {unit} {bound}")
