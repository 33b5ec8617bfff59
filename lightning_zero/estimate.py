"""The memory model: model-state bytes per rank for DDP and ZeRO stages 1-3, and the least complex option that fits.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_zero import config

#: The options in order of complexity; ``recommend`` returns the first that fits.
OPTIONS = ("ddp", "zero1", "zero2", "zero3")
#: The precision flags ZeroStrategy supports (``config.PRECISIONS``), each modelled from its working dtype.
PRECISIONS = tuple(config.PRECISIONS)
#: Which kinds each option shards: (parameters, gradients, optimizer state).
_SHARDED_KINDS = {
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "zero3": (True, True, True),
}


class EstimateError(ValueError):
    """An input to the memory model is invalid; the message names the field and the allowed values."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds for one option (the rank with the largest shard when a kind does not divide evenly)."""

    option: str
    ranks: int
    params: int
    grads: int
    optimizer: int
    buckets: int

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + self.buckets


@dataclass(frozen=True)
class Recommendation:
    """The least complex option whose estimate fits the per-rank budget, or ``choice=None`` when none does."""

    choice: str | None
    budget_bytes: int
    estimates: tuple[MemoryEstimate, ...]
    #: When nothing fits: the fewest ranks at which the most sharded option considered would fit (None if no number
    #: of ranks would, because the unsharded part alone exceeds the budget). None when something fits.
    min_ranks: int | None = None

    def explain(self) -> str:
        if self.choice is not None:
            chosen = next(e for e in self.estimates if e.option == self.choice)
            return (
                f"{self.choice}: the least complex option that fits ({format_bytes(chosen.total)} of "
                f"{format_bytes(self.budget_bytes)} per rank)"
            )
        most_sharded = self.estimates[-1]
        ranks = f"{most_sharded.ranks} rank" + ("s" if most_sharded.ranks != 1 else "")
        line = (
            f"nothing fits: {most_sharded.option} needs {format_bytes(most_sharded.total)} per rank on {ranks}, "
            f"the budget is {format_bytes(self.budget_bytes)}"
        )
        if self.min_ranks is None:
            return line + "; no number of ranks fits, because its unsharded part alone exceeds the budget"
        return line + f"; {most_sharded.option} fits on {self.min_ranks} ranks or more"


def estimate(
    option: str,
    num_params: int,
    ranks: int,
    precision: str = "32-true",
    bucket_mb: float = 25.0,
    trainable_params: int | None = None,
) -> MemoryEstimate:
    """Model-state bytes per rank for ``option`` (see [Note: what the memory model counts])."""
    _check_choice("option", option, OPTIONS)
    _check_choice("precision", precision, PRECISIONS)
    trainable = _check_counts(num_params, ranks, trainable_params)
    if not 0 <= bucket_mb < math.inf:
        raise EstimateError(f"bucket_mb={bucket_mb!r} is invalid: it must be a finite number of MiB >= 0")
    param_b, grad_b, optim_b = _bytes_per_element(precision)
    shard_params, shard_grads, shard_optim = _SHARDED_KINDS[option]
    return MemoryEstimate(
        option=option,
        ranks=ranks,
        params=param_b * _elements_per_rank(num_params, ranks, shard_params),
        grads=grad_b * _elements_per_rank(trainable, ranks, shard_grads),
        optimizer=optim_b * _elements_per_rank(trainable, ranks, shard_optim),
        buckets=0 if option == "ddp" else min(int(bucket_mb * 2**20), param_b * num_params),
    )


def estimate_all(
    num_params: int,
    ranks: int,
    precision: str = "32-true",
    bucket_mb: float = 25.0,
    trainable_params: int | None = None,
    options: tuple[str, ...] = OPTIONS,
) -> tuple[MemoryEstimate, ...]:
    return tuple(estimate(o, num_params, ranks, precision, bucket_mb, trainable_params) for o in options)


def recommend(
    num_params: int,
    ranks: int,
    budget_bytes: int,
    precision: str = "32-true",
    bucket_mb: float = 25.0,
    trainable_params: int | None = None,
    options: tuple[str, ...] = OPTIONS,
) -> Recommendation:
    """The first of ``options`` (least complex first: ddp < zero1 < zero2 < zero3) whose total fits ``budget_bytes``.

    ``options`` restricts the choice, e.g. to the stages implemented in this release.
    """
    if not options:
        raise EstimateError(f"options=() is invalid: name at least one of {', '.join(OPTIONS)}")
    if not budget_bytes > 0:
        raise EstimateError(f"budget_bytes={budget_bytes!r} is invalid: it must be > 0")
    ordered = tuple(o for o in OPTIONS if o in options)
    estimates = estimate_all(num_params, ranks, precision, bucket_mb, trainable_params, ordered)
    for e in estimates:
        if e.total <= budget_bytes:
            return Recommendation(e.option, budget_bytes, estimates)
    most_sharded = estimates[-1].option
    min_ranks = _min_ranks_to_fit(most_sharded, num_params, budget_bytes, precision, bucket_mb, trainable_params)
    return Recommendation(None, budget_bytes, estimates, min_ranks)


def communication_bytes(
    option: str, num_params: int, ranks: int, element_bytes: int, trainable_params: int | None = None
) -> int:
    """Ring-equivalent bytes one rank moves per optimizer step, with no overhead.

    DDP all-reduces the gradients (2 Ψ_t (N-1)/N elements); zero1 and zero2 reduce-scatter the gradients and
    all-gather the updated parameters (the same 2 Ψ_t (N-1)/N); zero3 all-gathers every parameter twice (forward and
    backward) and reduce-scatters the gradients: (2 Ψ + Ψ_t)(N-1)/N. Ψ_t counts trainable parameters: frozen ones
    are never reduced nor re-gathered after a step.
    """
    _check_choice("option", option, OPTIONS)
    trainable = _check_counts(num_params, ranks, trainable_params)
    elements = 2 * num_params + trainable if option == "zero3" else 2 * trainable
    return elements * element_bytes * (ranks - 1) // ranks


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


def _bytes_per_element(precision: str) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer state) bytes per element (see [Note: what the memory model counts])."""
    working = config.PRECISIONS[precision]
    if working is None:
        return 4, 4, 8  # one fp32 copy; the two Adam moments
    # 16-bit working parameters and gradients; fp32 master weights and the two moments in the optimizer state.
    return working.itemsize, working.itemsize, 12


def _elements_per_rank(elements: int, ranks: int, sharded: bool) -> int:
    return -(-elements // ranks) if sharded else elements


def _min_ranks_to_fit(
    option: str, num_params: int, budget_bytes: int, precision: str, bucket_mb: float, trainable: int | None
) -> int | None:
    at_one = estimate(option, num_params, 1, precision, bucket_mb, trainable)
    kinds = (at_one.params, at_one.grads, at_one.optimizer)
    sharded = sum(b for b, is_sharded in zip(kinds, _SHARDED_KINDS[option]) if is_sharded)
    fixed = at_one.total - sharded
    if sharded == 0 or fixed >= budget_bytes:
        return None
    ranks = max(1, math.ceil(sharded / (budget_bytes - fixed)))
    while estimate(option, num_params, ranks, precision, bucket_mb, trainable).total > budget_bytes:
        ranks += 1
    return ranks


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


def format_table(
    what: str, total: int, trainable: int, ranks: int, precision: str, estimates: tuple, budget: int | None
) -> str:
    """The ``lightning-zero estimate`` table: one row per option, with whether it fits ``budget``."""
    frozen = f", {trainable:,} trainable" if trainable != total else ""
    head = f"{'option':<8}{'params':>12}{'grads':>12}{'optimizer':>12}{'buckets':>12}{'total':>12}"
    lines = [
        f"{what}{frozen}, {ranks} ranks, precision {precision}: model states per rank (Adam; activations not included)",
        "",
        head + ("  fits " + format_bytes(budget) if budget is not None else ""),
    ]
    for e in estimates:
        cells = [format_bytes(b) for b in (e.params, e.grads, e.optimizer, e.buckets, e.total)]
        fits = ("  yes" if e.total <= budget else "  no") if budget is not None else ""
        lines.append(f"{e.option:<8}" + "".join(f"{c:>12}" for c in cells) + fits)
    return "\n".join(lines)
