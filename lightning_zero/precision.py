"""Precision for ZeroStrategy: full fp32, or 16-bit working parameters with fp32 master shards.

Lightning hands a custom strategy its generic plugins (``Precision``, ``MixedPrecision``); ZeroStrategy replaces them
with this one for the same flag, so that ``precision="bf16-mixed"`` means ZeRO's mixed precision: the module's
parameters and gradients in bf16, the fp32 master weights and the optimizer's moments only in the sharded optimizer
state. The plugin supplies dtypes, autocast, the fp16 loss scale and the clip request Lightning hands it; the step
itself (unscaling, the global norm, clipping, the update) is the runtime's (see [Note: one optimizer step]).
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

from lightning_zero.config import PRECISIONS


class ZeroGradScaler(torch.amp.GradScaler):
    """fp16 dynamic loss scaling whose overflow decisions are the same on every rank.

    A real ``torch.amp.GradScaler`` (``get_scale()``, ``get_growth_factor()``, ``state_dict()`` ... behave as
    usual), whose scale is updated by the sharded step from an overflow flag agreed across ranks, with torch's own
    update rule. The step unscales the gradient shards itself, so ``unscale_`` and ``step`` are not for user code.
    """

    def __init__(self, device: str = "cuda", **settings: Any) -> None:
        super().__init__(device, **settings)
        #: Optimizer steps skipped because a rank saw an inf or NaN gradient.
        self.skipped_steps = 0

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler | None, device: str) -> ZeroGradScaler:
        """The same settings as ``scaler`` (the one a ``MixedPrecision`` plugin was given)."""
        if scaler is None:
            return cls(device)
        return cls(
            device,
            init_scale=scaler.get_scale(),
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
        )

    def update_from(self, found_inf: Tensor) -> None:
        """Back off (``found_inf`` = 1) or count towards growth, as ``GradScaler.update`` does."""
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(found_inf.device)
        found_inf = found_inf.to(device=self._scale.device, dtype=torch.float32).reshape(1)
        torch._amp_update_scale_(
            self._scale, self._growth_tracker, found_inf, self._growth_factor, self._backoff_factor,
            self._growth_interval,
        )
        if found_inf.item():
            self.skipped_steps += 1

    @override
    def unscale_(self, optimizer: Optimizer) -> None:
        raise RuntimeError("under ZeroStrategy the sharded optimizer step unscales the gradient shards itself")

    @override
    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("under ZeroStrategy call optimizer.step(); the strategy applies the loss scale")


class ZeroPrecision(Precision):
    """``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"`` (fp16 with dynamic loss scaling) under ZeroStrategy."""

    def __init__(self, precision: str = "32-true", device: str = "cpu", scaler: ZeroGradScaler | None = None) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not supported by ZeroStrategy: allowed values are {allowed()}")
        self.precision = precision
        self.device = device
        self.working_dtype: torch.dtype | None = PRECISIONS[precision]
        self.scaler = (scaler or ZeroGradScaler(device)) if precision == "16-mixed" else None
        self._clip: tuple[str, float] | None = None

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
            tensor = self.scaler.scale(tensor)
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
            self._clip = (GradClipAlgorithmType(gradient_clip_algorithm).value, float(clip_val))

    def take_clip(self) -> tuple[str, float] | None:
        """The clip request of this step (``("norm" | "value", value)``), once."""
        clip, self._clip = self._clip, None
        return clip

    def closure_with_hooks(self, model: pl.LightningModule, optimizer: Optimizer, closure: Callable[[], Any]) -> Any:
        """Lightning's closure followed by its ``on_before_optimizer_step`` hooks and clipping request."""
        return self._wrap_closure(model, optimizer, closure)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def allowed() -> str:
    return ", ".join(repr(p) for p in PRECISIONS)


def zero_precision_for(plugin: Precision | None) -> ZeroPrecision:
    """The ZeroPrecision for the plugin Lightning chose from the user's ``precision`` flag."""
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin or ZeroPrecision()
    if type(plugin) is Precision:
        return ZeroPrecision("32-true")
    if isinstance(plugin, MixedPrecision):
        # fp16: the sharded scaler takes the settings of the GradScaler the plugin was given (init scale, growth).
        scaler = ZeroGradScaler.like(plugin.scaler, plugin.device) if plugin.precision == "16-mixed" else None
        return ZeroPrecision(plugin.precision, plugin.device, scaler)
    flag = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(f"precision={flag!r} is not supported by ZeroStrategy: allowed values are {allowed()}")
