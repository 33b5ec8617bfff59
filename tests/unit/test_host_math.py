"""host_math.py: MKL's VML kernel for ``sqrt`` is chosen by single-threaded one-element calls, before the first
optimizer step (see [Note: MKL picks a VML kernel on first call, and several first calls at once can race])."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

import lightning_zero.strategy
from lightning_zero import ZeroStrategy
from lightning_zero.host_math import settle_mkl_dispatch
from tests.harness import run_on_ranks
from tests.models import ParityModel, make_trainer


def test_sqrt_is_called_once_per_float_dtype_on_one_element(monkeypatch) -> None:
    calls = []
    real = torch.sqrt
    monkeypatch.setattr(torch, "sqrt", lambda x: calls.append((x.dtype, x.numel(), x.device.type)) or real(x))
    settle_mkl_dispatch.__wrapped__()  # the function itself, not its once-per-process cache
    assert calls == [(torch.float32, 1, "cpu"), (torch.float64, 1, "cpu")]


def _events_of_a_fit(rank: int, world_size: int) -> list[str]:
    events: list[str] = []
    lightning_zero.strategy.settle_mkl_dispatch = lambda: events.append("settle")  # this forked rank only

    class Events(pl.Callback):
        def setup(self, *_args, **_kwargs) -> None:
            events.append("setup")

        def on_before_optimizer_step(self, *_args) -> None:
            events.append("step")

    pl.seed_everything(0, verbose=False)
    make_trainer(ZeroStrategy(stage=2), 1, max_steps=2, callbacks=[Events()]).fit(ParityModel("adamw"))
    return events


def test_the_strategy_settles_mkl_before_setup_and_the_first_step() -> None:
    (events,) = run_on_ranks(_events_of_a_fit, 1)
    assert events == ["settle", "setup", "step", "step"]
