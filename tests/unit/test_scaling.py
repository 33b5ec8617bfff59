"""The step's arithmetic (sharding/scaling.py): clipping by norm keeps the clip coefficient on the device, with no
host synchronisation; the policies that must decide on the host (fp16 loss scaling, nonfinite_grads="skip") do
synchronise, as documented in [Note: no host synchronisation in a step]."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.scaling import StepScaling, scale_

SYNCING = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


@contextmanager
def count_host_reads():
    """Counts calls of the tensor methods that make the host wait for the device."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def counting(name):
        def method(self, *args, **kwargs):
            calls.append(name)
            return originals[name](self, *args, **kwargs)

        return method

    for name in SYNCING:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(7, 3, generator=g), torch.randn(5, generator=g), torch.randn(0)]


def test_clip_by_norm_stays_on_the_device() -> None:
    grads = _grads()
    expected_norm = torch.cat([g.reshape(-1) for g in grads]).norm()
    scaling = StepScaling(Collectives(), "ignore")
    with count_host_reads() as calls:
        factor = scaling.agree(grads, None, ("norm", 0.5))
        scale_(grads, factor, None)
    assert calls == []
    assert torch.is_tensor(factor) and factor.dim() == 0
    torch.testing.assert_close(scaling.last_grad_norm, expected_norm)
    torch.testing.assert_close(torch.cat([g.reshape(-1) for g in grads]).norm(), torch.tensor(0.5), rtol=1e-5, atol=0)


def test_nothing_to_agree_on_is_free() -> None:
    with count_host_reads() as calls:
        factor = StepScaling(Collectives(), "ignore").agree(_grads(), None, ("value", 0.1))
    assert calls == [] and factor == 1.0


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_policies_that_decide_on_the_host_synchronise(policy: str) -> None:
    with count_host_reads() as calls:
        StepScaling(Collectives(), policy).agree(_grads(), None, None)
    assert calls  # whether to step at all is a host decision


def test_fp16_loss_scaling_synchronises_and_unscales() -> None:
    grads = _grads()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with count_host_reads() as calls:
        factor = StepScaling(Collectives(), "ignore").agree(grads, scaler, None)
    assert calls and factor == pytest.approx(0.25)
