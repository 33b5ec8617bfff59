"""host_math.py: MKL's VML kernel for ``sqrt`` is chosen by single-threaded one-element calls (see [Note: MKL picks a
VML kernel on first call, and several first calls at once can race]); that a fit makes them before its first
optimizer step is tested in tests/integration/test_trainer.py."""

from __future__ import annotations

import torch

from lightning_zero.host_math import settle_mkl_dispatch


def test_sqrt_is_called_once_per_float_dtype_on_one_element(monkeypatch) -> None:
    calls = []
    real = torch.sqrt
    monkeypatch.setattr(torch, "sqrt", lambda x: calls.append((x.dtype, x.numel(), x.device.type)) or real(x))
    settle_mkl_dispatch.__wrapped__()  # the function itself, not its once-per-process cache
    assert calls == [(torch.float32, 1, "cpu"), (torch.float64, 1, "cpu")]
