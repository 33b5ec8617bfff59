"""One real training step of a model on a tiny batch, measured: what ``lightning-zero estimate --measure`` and
``strategy=auto`` (``AutoStrategy.measure``) add to the model states to predict a run's peak memory per rank.

[Note: what a measured step gives the memory model]
The model is built in full on this machine (its parameters and gradients must fit here) in a fresh process
(``spawn``), so that the process's own memory is what a training rank starts from: the interpreter, torch,
Lightning and lightning_zero (``StepMeasure.baseline``, the resident set before the model is built; on CUDA the
device holds none of it and the baseline is 0). Forward and backward then run at two tiny batch sizes, 1 and 2
sequences, and each one's peak is read: on the CPU the process's high-water mark (VmHWM, reset before each), which
sees what a rank's resident set sees, allocator included; on CUDA ``torch.cuda.max_memory_allocated``; freed heap
memory is given back to the system before each (``malloc_trim``), or the second would reuse the first's. Each peak
is taken above the memory held before its forward, and the two differ by one sequence's activations (what forward keeps for backward, and backward's transient gradients of the
activations); the smaller peak, less the parameters, their gradients and that one sequence, is what a step holds
whatever the batch (``activation_fixed``). ``activations(batch)`` scales them to a run's micro-batch per rank.

The step is the plain module's, unsharded and at world size 1: activations do not depend on how the model states
are sharded (a ZeRO stage changes where parameters live, not what forward saves). The stage-3 units are measured by
the same walk the strategy does (``sharding.units.plan_units``, default units) on a copy built on the meta device.
"""

from __future__ import annotations

import functools
import multiprocessing
from dataclasses import dataclass
from typing import Any

#: The tiny batch sizes a step is measured at (sequences).
BATCHES = (1, 2)


@dataclass(frozen=True)
class StepMeasure:
    """What one measured step of a model gives the memory model (see [Note: what a measured step gives the memory
    model]); bytes, the model's elements in its built dtype."""

    #: Memory a rank holds before its model is built (CPU: the process's resident set after imports; CUDA: 0).
    baseline: int
    #: Activations (and backward's transient activation gradients) per sequence of the micro-batch.
    activation_per_sample: int
    #: What a forward and backward hold beyond the parameters, their gradients and the per-sequence part.
    activation_fixed: int
    #: Elements of the largest stage-3 unit, and of the root unit (gathered for the whole step).
    unit_elements: int
    root_unit_elements: int
    #: Bytes of one element of the model as built (its parameters' dtype: 4 for fp32).
    element_bytes: int = 4
    #: Seconds of one forward and backward per sequence of the micro-batch (one thread on a CPU, as the ranks run;
    #: the fastest of a few timings at the larger tiny batch): the link model's compute (see [Note: the link model]
    #: in link_model.py).
    seconds_per_sample: float = 0.0

    def activations(self, batch: int) -> int:
        return self.activation_fixed + batch * self.activation_per_sample

    def compute_s(self, batch: int) -> float:
        """Seconds a rank computes a step at ``batch`` sequences (the optimizer step left out)."""
        return batch * self.seconds_per_sample


@functools.lru_cache(maxsize=4)  # `lightning-zero train` builds its job twice (a check, then the run)
def measure_step(
    model_config: Any, vocab_size: int, seq_len: int, device: str = "cpu", units: tuple[str, ...] = ()
) -> StepMeasure:
    """Measure one step of ``model_config.build()`` (token ids -> logits) in a fresh process (see the module Note);
    ``units``: stage 3's ``units`` setting, for the unit sizes. ``model_config`` must be hashable (a frozen
    dataclass): a process measures each model once."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(_measure_in_this_process, (model_config, vocab_size, seq_len, device, units))


def _measure_in_this_process(
    model_config: Any, vocab_size: int, seq_len: int, device: str, units: tuple[str, ...]
) -> StepMeasure:
    import lightning.pytorch  # noqa: F401  (a training rank has these loaded: they are part of its baseline)
    import torch

    import lightning_zero  # noqa: F401
    from lightning_zero.models.language_model import _next_token_loss
    from lightning_zero.offload.disk import give_back_freed_memory

    torch.set_num_threads(1)
    on_cuda = device.startswith("cuda")
    _warm_up(torch)
    baseline = 0 if on_cuda else _status("VmRSS")
    unit, root = unit_elements(model_config, units)
    with torch.device(device):
        model = model_config.build()
    params = list(model.parameters())
    element_bytes = params[0].element_size() if params else 4
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    # A first pass loads what a step loads once (kernels, autograd's workers): in neither measured peak.
    warm = torch.randint(0, vocab_size, (1, seq_len + 1), device=device)
    _next_token_loss(model(warm[:, :-1]), warm[:, 1:]).backward()
    rises = []
    for batch in BATCHES:
        tokens = torch.randint(0, vocab_size, (batch, seq_len + 1), device=device)
        model.zero_grad(set_to_none=True)
        give_back_freed_memory()
        before = torch.cuda.memory_allocated(device) if on_cuda else _status("VmRSS")
        _reset_peak(torch, on_cuda)
        _next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        rises.append(_peak(torch, on_cuda, device) - before)
    per_sample = max(0, rises[1] - rises[0])
    fixed = max(0, rises[0] - grad_bytes - per_sample)
    # Compute grows with the tokens: the larger tiny batch, per sequence (two timings this small do not resolve a
    # fixed part, which came out negative as often as not).
    seconds_per_sample = _fastest_step(torch, model, vocab_size, seq_len, BATCHES[-1], device) / BATCHES[-1]
    return StepMeasure(baseline, per_sample, fixed, unit, root, element_bytes, seconds_per_sample)


def _fastest_step(torch: Any, model: Any, vocab_size: int, seq_len: int, batch: int, device: str,
                  repeats: int = 3) -> float:
    """The fastest of ``repeats`` forwards and backwards at ``batch`` sequences, in seconds."""
    import time

    from lightning_zero.models.language_model import _next_token_loss

    tokens = torch.randint(0, vocab_size, (batch, seq_len + 1), device=device)
    best = float("inf")
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        _next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def unit_elements(model_config: Any, units: tuple[str, ...] = ()) -> tuple[int, int]:
    """Elements of the largest stage-3 unit and of the root unit for stage 3's ``units`` setting (``plan_units``),
    counted on a copy of the model built on the meta device."""
    import torch

    from lightning_zero.config import Stage3Config
    from lightning_zero.sharding.units import plan_units

    with torch.device("meta"):
        model = model_config.build()
    root, plans = plan_units(model, tuple(units), Stage3Config().unit_bytes)
    largest = max((sum(p.numel() for p in u.params) for u in plans), default=0)
    return largest, sum(p.numel() for p in root.params)


def _warm_up(torch: Any) -> None:
    """What a training rank has done before its model exists: a tiny step, so the kernels' lazily loaded code and
    the allocator's first arenas are in the baseline and not in the measured step."""
    layer = torch.nn.Linear(8, 8)
    torch.optim.AdamW(layer.parameters())
    layer(torch.randn(2, 8)).sum().backward()


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak(torch: Any, on_cuda: bool) -> None:
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
        return
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak(torch: Any, on_cuda: bool, device: str) -> int:
    return torch.cuda.max_memory_allocated(device) if on_cuda else _status("VmHWM")
