"""Optimizers users write themselves whose update is not element-wise (issue 36): a LARS and a Muon with an auxiliary
AdamW for the parameters Muon does not take, as one optimizer class. Neither is known to ZeroStrategy, so
``optimizer_sharding="auto"`` steps each parameter whole on one rank."""

from __future__ import annotations

import torch
from torch.optim import Optimizer


class LARS(Optimizer):
    """SGD with momentum whose step for each parameter is scaled by the trust ratio ``eta |w| / (|g| + wd |w|)``
    (You et al., 2017): it depends on the norms of the whole parameter and gradient."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 1e-4, eta: float = 1e-3):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad + group["weight_decay"] * p
                w_norm, g_norm = p.norm(), p.grad.norm()
                trust = torch.where((w_norm > 0) & (g_norm > 0),
                                    group["eta"] * w_norm / (g_norm + group["weight_decay"] * w_norm),
                                    torch.ones_like(w_norm))
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(update * trust)
                p.add_(buf, alpha=-group["lr"])
        return loss


def _evaluate(closure):
    """An optimizer's closure (Lightning's forward and backward), run with gradients enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def newton_schulz(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The orthogonal factor of ``matrix`` by Muon's quintic Newton-Schulz iteration."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix / (matrix.norm() + 1e-7)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.t()
    for _ in range(steps):
        gram = x @ x.t()
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.t() if transposed else x


class MuonWithAuxAdam(Optimizer):
    """One optimizer for a whole model, as Muon's reference code is used: groups with ``use_muon=True`` get Muon
    (momentum orthogonalized by Newton-Schulz), the others AdamW."""

    def __init__(self, param_groups):
        groups = []
        for group in param_groups:
            muon = group.get("use_muon", False)
            defaults = dict(lr=2e-2, momentum=0.95, weight_decay=0.0) if muon else dict(
                lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
            groups.append({**defaults, **group, "use_muon": muon})
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["use_muon"]:
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(p.grad, 1 - group["momentum"])
                    update = newton_schulz(p.grad.lerp(buf, group["momentum"]).reshape(p.shape[0], -1))
                    scale = max(1.0, p.shape[0] / update.shape[1]) ** 0.5
                    p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update.view_as(p), alpha=-group["lr"] * scale)
                else:
                    state["step"] = state.get("step", 0) + 1
                    exp_avg = state.setdefault("exp_avg", torch.zeros_like(p))
                    exp_avg_sq = state.setdefault("exp_avg_sq", torch.zeros_like(p))
                    beta1, beta2 = group["betas"]
                    exp_avg.lerp_(p.grad, 1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    corrected = (exp_avg / (1 - beta1 ** state["step"])) / (
                        (exp_avg_sq / (1 - beta2 ** state["step"])).sqrt() + group["eps"])
                    p.mul_(1 - group["lr"] * group["weight_decay"]).add_(corrected, alpha=-group["lr"])
        return loss
