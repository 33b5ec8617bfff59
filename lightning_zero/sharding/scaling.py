"""The arithmetic of one optimizer step: the factor every gradient shard is multiplied by (the fp16 loss scale's
inverse times the clip coefficient), the global norm it needs, and what a non-finite gradient does to the step.

The runtime (runtime.py) sequences the step; this module only computes, with one all-reduce of a few floats per
step when anything needs the global norm.

[Note: no host synchronisation in a step]
The global norm and the clip coefficient stay tensors on the device: ``clip / (norm + 1e-6)`` clamped to 1 is folded
with the loss-scale inverse into one 0-d factor that ``scale_`` multiplies the shards by, so clipping by norm never
makes the host wait for the device. Three things do, because the host must decide something: fp16 loss scaling
(whether to skip the step and back off), ``nonfinite_grads="skip"`` or ``"raise"`` (whether to step at all), and
optimizer offload (the host runs the update, so it reads the factor). ``grad_norm`` returns Python floats for
logging, at the user's request.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_zero.precision import update_loss_scale
from lightning_zero.sharding.collectives import Collectives


class NonFiniteGradientsError(FloatingPointError):
    """A rank's gradients held an inf or NaN and ``nonfinite_grads="raise"``; the message names the ranks."""


class StepScaling:
    """Agrees across ranks on the factor a step multiplies the gradient shards by (see the module docstring)."""

    def __init__(self, comms: Collectives, nonfinite_grads: str) -> None:
        self.comms = comms
        self.policy = nonfinite_grads
        #: The global gradient norm (a device tensor) before the last clip by norm.
        self.last_grad_norm: Tensor | None = None
        #: Optimizer steps skipped because a rank's gradients held an inf or NaN (``nonfinite_grads="skip"``).
        self.skipped_steps = 0

    @torch.no_grad()
    def agree(self, grads: list[Tensor], scaler: Any, clip: tuple[str, float] | None,
              unscaled: bool = False) -> Tensor | float | None:
        """The factor the gradients are multiplied by (the loss scale's inverse, the clip coefficient), or ``None``
        when the step is skipped on every rank; see [Note: non-finite gradients]. ``scaler``: the fp16
        ``torch.amp.GradScaler`` (see [Note: the fp16 loss scaler] in precision.py), updated here; ``unscaled``: the
        gradients were unscaled already (for user hooks)."""
        if scaler is not None and not scaler.is_enabled():
            scaler = None  # as torch disables a GradScaler made for CUDA where there is none: DDP steps unscaled too
        inv_scale = 1.0 / scaler.get_scale() if scaler is not None and not unscaled else 1.0
        by_norm = clip is not None and clip[0] == "norm"
        factor: Tensor | float = inv_scale
        if scaler is None and not by_norm and self.policy == "ignore":
            return factor
        norm, failed = self._global_norm(grads)
        norm = norm * inv_scale
        if scaler is not None:
            update_loss_scale(scaler, ~torch.isfinite(norm))
        if (scaler is not None or self.policy != "ignore") and not torch.isfinite(norm).item():
            if scaler is None:
                self._on_nonfinite(failed)
            return None
        if by_norm:
            self.last_grad_norm = norm
            factor = inv_scale * torch.clamp(clip[1] / (norm + 1e-6), max=1.0)
        return factor

    def _on_nonfinite(self, failed: Tensor) -> None:
        """[Note: non-finite gradients] An inf or NaN in any rank's gradients makes the global norm non-finite on
        every rank at once (one all-reduce carries the sum of squares and which ranks saw one), so every rank takes
        the same decision: fp16 loss scaling backs off and skips the step (as GradScaler); otherwise
        ``nonfinite_grads="skip"`` skips it and warns, ``"raise"`` raises, both naming the ranks, and ``"ignore"``
        (the default, with no check at all) steps as DDP would: the non-finite values spread through the averaged
        gradients alike on every rank, so the ranks never diverge from one another."""
        ranks = [self.comms.global_rank(r) for r, bad in enumerate(failed.tolist()) if bad]
        where = f"rank(s) {ranks}" if ranks else "the global norm (its sum of squares overflowed)"
        message = f"non-finite gradients (inf or NaN) on {where} at this optimizer step"
        if self.policy == "raise":
            raise NonFiniteGradientsError(message + "; nonfinite_grads='skip' skips such steps instead")
        self.skipped_steps += 1
        rank_zero_warn(message + "; the step was skipped on every rank (nonfinite_grads='skip')")

    def _global_norm(self, grads: list[Tensor]) -> tuple[Tensor, Tensor]:
        """The L2 norm of every rank's gradient shards together (padding excluded), and which ranks' shards hold an
        inf or NaN: one all-reduce, over the shard group under hybrid sharding (its replicas hold the same shards:
        see [Note: hybrid sharding] in topology.py), where the ranks named are this replica's."""
        stats = torch.zeros(1 + self.comms.world_size, dtype=torch.float32, device=self.comms.device)
        for dtype in dict.fromkeys(g.dtype for g in grads):
            group = [g for g in grads if g.dtype == dtype and g.numel() > 0]
            if group:
                norms = torch._foreach_norm(group, 2, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
                stats[0] += torch.stack(norms).float().square().sum().to(stats.device)
        stats[1 + self.comms.rank] = (~torch.isfinite(stats[0])).float()
        self.comms.all_reduce_(stats, "the gradient norm")
        return stats[0].sqrt(), stats[1:]


def scale_(tensors: list[Tensor], factor: Tensor | float, clip_value: float | None) -> None:
    """Multiply gradient shards by ``factor`` (a device tensor or a float) and clamp them to ``clip_value``."""
    if tensors and (torch.is_tensor(factor) or factor != 1.0):
        torch._foreach_mul_(tensors, factor)
    if clip_value is not None and tensors:
        torch._foreach_clamp_min_(tensors, -clip_value)
        torch._foreach_clamp_max_(tensors, clip_value)
