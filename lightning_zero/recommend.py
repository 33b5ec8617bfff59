"""The least complex option that fits a budget (``recommend``), by the memory model's states (memory_model.py) or,
given a measured step, by the peak of a run (peak_model.py); estimate.py re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_zero import config
from lightning_zero.estimate_options import IN_DEVICE_OPTIONS, LAYOUTS, OPTIONS, EstimateError, format_bytes
from lightning_zero.memory_model import Budget, MemoryEstimate, estimate
from lightning_zero.peak_model import PeakInputs, peak_estimate, with_peak


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
