"""The options the memory and communication models compare (``LAYOUTS``: DDP, ZeRO stages 1-3 and their offload
placements), the precisions they model, and the checks and conversions of their inputs; estimate.py re-exports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_zero import config


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
    settings = [f"strategy.{k}={v}" for k, v in options.items() if k != "stage"]
    cli = " ".join([f"strategy=zero{options['stage']}", *settings])
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
