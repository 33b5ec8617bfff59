"""Precision for ZeroStrategy: full fp32, or 16-bit working parameters with fp32 master shards.

Lightning hands a custom strategy its generic plugins (``Precision``, ``MixedPrecision``); ZeroStrategy replaces them
with this one for the same flag, so that ``precision="bf16-mixed"`` means ZeRO's mixed precision: the module's
parameters and gradients in bf16, the fp32 master weights and the optimizer's moments only in the sharded optimizer
state. Clipping and fp16 loss scaling must see every shard, so they run here, on the reduced gradient shards, rather
than through ``torch.nn.utils.clip_grad_norm_`` on one rank's pieces (see [Note: gradients at the optimizer step]).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.sharding.optimizer import ShardedOptimizer

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed")
_WORKING_DTYPES = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class LossScaler:
    """Dynamic fp16 loss scaling whose decisions are the same on every rank (the overflow flag is all-reduced)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0
        self.skipped_steps = 0

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler | None) -> LossScaler:
        """The same settings as a ``torch.amp.GradScaler`` (the one a ``MixedPrecision`` plugin was given)."""
        if scaler is None:
            return cls()
        return cls(
            scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()
        )

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


class ZeroPrecision(Precision):
    """``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"`` (fp16 with dynamic loss scaling) under ZeroStrategy."""

    def __init__(self, precision: str = "32-true", device: str = "cpu", scaler: LossScaler | None = None) -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"precision={precision!r} is not supported by ZeroStrategy: allowed values are "
                f"{', '.join(repr(p) for p in SUPPORTED_PRECISION)}"
            )
        self.precision = precision
        self.device = device
        self.working_dtype: torch.dtype | None = _WORKING_DTYPES[precision]
        self.scaler = (scaler or LossScaler()) if precision == "16-mixed" else None
        self.sharded: Callable[[Optimizer], ShardedOptimizer] | None = None
        #: Global gradient norm before clipping, of the last step that clipped by norm.
        self.last_grad_norm: Tensor | None = None
        self._clip: tuple[GradClipAlgorithmType, float] | None = None

    @contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        if self.working_dtype is None:
            yield
            return
        with torch.autocast(self.device, dtype=self.working_dtype, cache_enabled=False):
            yield

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = tensor * self.scaler.scale
        return super().pre_backward(tensor, module)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Recorded here, applied over all shards at the step (the reduced gradients are only complete then)."""
        if clip_val > 0:
            self._clip = (GradClipAlgorithmType(gradient_clip_algorithm), float(clip_val))

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        assert self.sharded is not None, "ZeroPrecision is only usable through ZeroStrategy"
        closure_result = closure()
        self._after_closure(model, optimizer)
        clip, self._clip = self._clip, None
        if closure_result is None and model.automatic_optimization:
            return closure_result  # training_step returned None: no backward, no step (as Lightning's AMP)
        sharded = self.sharded(optimizer)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.scaler is not None:
            found_inf = sharded.found_inf()
            self.scaler.update(found_inf)
            if found_inf:
                return closure_result
        factor, clip_value = 1.0 / scale, None
        if clip is not None and clip[0] == GradClipAlgorithmType.NORM:
            self.last_grad_norm = sharded.grad_norm(scale)
            factor *= min(1.0, clip[1] / (float(self.last_grad_norm) + 1e-6))
        elif clip is not None:
            clip_value = clip[1]
        sharded.prepare_step(factor, clip_value)
        try:
            return optimizer.step(**kwargs)
        finally:
            sharded.finish_step()

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def zero_precision_for(plugin: Precision | None) -> ZeroPrecision:
    """The ZeroPrecision for the plugin Lightning chose from the user's ``precision`` flag."""
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin or ZeroPrecision()
    if type(plugin) is Precision:
        return ZeroPrecision("32-true")
    if isinstance(plugin, MixedPrecision):
        # fp16: the sharded scaler takes the settings of the GradScaler the plugin was given (init scale, growth).
        scaler = LossScaler.like(plugin.scaler) if plugin.precision == "16-mixed" else None
        return ZeroPrecision(plugin.precision, plugin.device, scaler)
    flag = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"precision={flag!r} is not supported by ZeroStrategy: allowed values are "
        f"{', '.join(repr(p) for p in SUPPORTED_PRECISION)}"
    )
