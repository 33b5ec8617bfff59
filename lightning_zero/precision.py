"""Precision for ZeroStrategy: full fp32, or 16-bit working parameters with fp32 master shards.

Lightning hands a custom strategy its generic plugins (``Precision``, ``MixedPrecision``); ZeroStrategy replaces them
with ``ZeroPrecision`` or ``ZeroMixedPrecision`` (still a ``MixedPrecision``, with the same ``GradScaler``) for the
same flag, so that ``precision="bf16-mixed"`` means ZeRO's mixed precision: the module's parameters and gradients in
bf16, the fp32 master weights and the optimizer's moments only in the sharded optimizer state. The plugin supplies
dtypes, autocast, the fp16 loss scaler and the clip request Lightning hands it; the step itself (unscaling, the
global norm, clipping, the update) is the runtime's (see [Note: one optimizer step]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.config import PRECISIONS


class ZeroPrecision(Precision):
    """``"32-true"`` under ZeroStrategy (``ZeroMixedPrecision`` adds the 16-bit flags): records the clip request
    Lightning hands it for the sharded step to apply over all shards."""

    def __init__(self, precision: str = "32-true", device: str = "cpu") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not supported by ZeroStrategy: allowed values are {allowed()}")
        self.precision = precision
        self.device = device
        self.working_dtype: torch.dtype | None = PRECISIONS[precision]
        #: The fp16 loss scaler, a ``torch.amp.GradScaler`` (``ZeroMixedPrecision``); none in full precision.
        self.scaler: torch.amp.GradScaler | None = None
        self._clip: tuple[str, float] | None = None

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


class ZeroMixedPrecision(ZeroPrecision, MixedPrecision):
    """``"bf16-mixed"`` or ``"16-mixed"`` under ZeroStrategy: 16-bit working parameters and gradients, fp32 master
    shards in the optimizer, autocast as Lightning's ``MixedPrecision`` (which this is, as under DDP).

    [Note: the fp16 loss scaler]
    ``scaler`` is the ``torch.amp.GradScaler`` the ``MixedPrecision`` plugin was given or made (Lightning makes
    ``GradScaler(device)`` for ``precision="16-mixed"``), the very object, so its whole API, its ``state_dict`` and
    any reference user code keeps behave as under DDP. It scales the loss in ``pre_backward`` (``scale``) and is
    updated once per optimizer step by torch's own ``update``, fed with the overflow flag the ranks agreed on
    (``update_loss_scale``): one rank's inf or NaN skips the step and backs off the scale on every rank, as DDP's
    all-reduced gradients do. Unscaling, clipping and stepping are the sharded step's, so user code calls neither
    ``unscale_`` nor ``step`` on it (as under DDP, where Lightning calls them).
    """

    def __init__(self, precision: str = "bf16-mixed", device: str = "cpu", scaler: torch.amp.GradScaler | None = None):
        ZeroPrecision.__init__(self, precision, device)
        MixedPrecision.__init__(self, precision, device, scaler)  # type: ignore[arg-type]

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The scaler's state from where a checkpoint holds it: under ``MixedPrecision`` (DDP's checkpoints, and ours,
        so that each resumes from the other) or ``ZeroPrecision`` (lightning_zero's before this class). Lightning
        itself only looks under this class's own name."""
        if type(self).__qualname__ in checkpoint:
            return
        for key in ("MixedPrecision", "ZeroPrecision"):
            if checkpoint.get(key):
                self.load_state_dict(checkpoint[key])
                return


def update_loss_scale(scaler: torch.amp.GradScaler, found_inf: Tensor) -> None:
    """``scaler.update()`` with ``found_inf`` (1.0 where any rank's gradients overflowed) as the step's inf check:
    torch's own update rule (back off, or count towards growth) on the scaler's own state."""
    if scaler._scale is None:  # no loss was scaled since the scaler was made or loaded (as GradScaler.scale does)
        scaler._lazy_init_scale_growth_tracker(found_inf.device)
    state = scaler._per_optimizer_states[id(scaler)]  # update() combines every recorded check, whatever the key
    state["found_inf_per_device"] = {found_inf.device: found_inf.float().reshape(())}
    scaler.update()


def allowed() -> str:
    return ", ".join(repr(p) for p in PRECISIONS)


def zero_precision_for(plugin: Precision | None) -> ZeroPrecision:
    """The ZeroPrecision for the plugin Lightning chose from the user's ``precision`` flag (or the user gave)."""
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin or ZeroPrecision()
    if type(plugin) is Precision:
        return ZeroPrecision("32-true")
    if isinstance(plugin, MixedPrecision):
        return ZeroMixedPrecision(plugin.precision, plugin.device, plugin.scaler)  # the same GradScaler object
    flag = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(f"precision={flag!r} is not supported by ZeroStrategy: allowed values are {allowed()}")
