"""Precision for ZeroStrategy: full fp32, or 16-bit working parameters with fp32 master shards.

Lightning hands a strategy the plugin for the user's ``precision`` flag (``Precision``, ``MixedPrecision``) or the
one the user gave; ZeroStrategy makes it a ``ZeroPrecision`` or ``ZeroMixedPrecision`` (still a ``MixedPrecision``,
with the same ``GradScaler``) in place, so that ``precision="bf16-mixed"`` means ZeRO's mixed precision: the
module's parameters and gradients in bf16, the fp32 master weights and the optimizer's moments only in the sharded
optimizer state. The plugin supplies dtypes, autocast, the fp16 loss scaler and the clip request Lightning hands it;
the step itself (unscaling, the global norm, clipping, the update) is the runtime's (see [Note: one optimizer step]).

[Note: the user's precision plugin]
Under DDP a plugin the user passes (``plugins=[MyAMP("16-mixed", "cuda")]``, ``MyAMP`` a ``MixedPrecision``
subclass) is the Trainer's ``precision_plugin`` itself, its overrides in force. Here the same object stays the
Trainer's plugin: its class becomes one of the user's class's name deriving from the user's class first and then
from ``ZeroMixedPrecision`` (``zero_class_for``), and it gains the few attributes the sharded step reads. So
``isinstance(trainer.precision_plugin, MyAMP)`` holds, the user's overrides of autocast (``forward_context`` and
the like), ``pre_backward``/``backward``, ``convert_*``, ``state_dict`` or ``clip_gradients`` run as under DDP
(their ``super()`` calls reaching ours), the checkpoint keeps the scaler under the user's class name as DDP's does,
and the object pickles for the spawn launcher as the user's class plus its attributes. Three methods cannot be
honoured: ``optimizer_step``, ``clip_grad_by_norm`` and ``clip_grad_by_value`` run Lightning's per-process step
and clipping, which the sharded step replaces (it never calls them: the gradients are sharded then); a plugin that
overrides one is refused when the strategy gets it, naming the method. Lightning's other plugins (XLA, FSDP,
DeepSpeed, double and half precision, bitsandbytes, Transformer Engine) change the dtypes or the step in ways the
sharded step does not implement, and are refused naming the plugin class and what is supported.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
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
        #: The fp16 loss scaler, a ``torch.amp.GradScaler`` (``ZeroMixedPrecision``); none in full precision.
        self.scaler: torch.amp.GradScaler | None = None
        self._start_zero_state()

    def _start_zero_state(self) -> None:
        """What the sharded step reads from the plugin, beyond Lightning's own attributes (``precision``)."""
        self.working_dtype: torch.dtype | None = PRECISIONS[self.precision]
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

    def closure_with_hooks(self, model: pl.LightningModule, optimizer: Optimizer, closure: Callable[[], Any],
                           before_hooks: Callable[[], None] | None = None) -> Any:
        """Lightning's closure followed by its ``on_before_optimizer_step`` hooks and clipping request;
        ``before_hooks`` runs between them unless the closure skipped the backward (Lightning's AMP plugin unscales
        the gradients there)."""
        result = closure()
        if before_hooks is not None and not (result is None and model.automatic_optimization):
            before_hooks()
        self._after_closure(model, optimizer)
        return result


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


#: Methods of Lightning's ``Precision`` that the sharded step does instead (see [Note: the user's precision plugin]).
_STEP_METHODS = ("optimizer_step", "clip_grad_by_norm", "clip_grad_by_value")


def as_zero_precision(plugin: Precision) -> ZeroPrecision:
    """The plugin Lightning chose for the user's ``precision`` flag, or the one the user gave, made ZeroStrategy's in
    place: the same object, its class a subclass of its own and of ``ZeroPrecision`` (see
    [Note: the user's precision plugin]). Raises ``ValueError`` naming the plugin class and what is supported for any
    other plugin (XLA, FSDP, DeepSpeed, double, half, bitsandbytes, Transformer Engine)."""
    if isinstance(plugin, ZeroPrecision):
        return plugin
    _check_supported(plugin)
    plugin.__class__ = zero_class_for(type(plugin))
    if not isinstance(plugin, MixedPrecision):
        plugin.scaler = None
    plugin._start_zero_state()
    return plugin


def _check_supported(plugin: Precision) -> None:
    cls = type(plugin)
    flag = getattr(plugin, "precision", None)
    if flag not in PRECISIONS:
        raise ValueError(f"precision={flag!r} is not supported by ZeroStrategy: allowed values are {allowed()} "
                         f"(the precision plugin is {cls.__name__})")
    lightnings_own = [c.__name__ for c in cls.__mro__ if _is_lightning_class(c) and c not in MixedPrecision.__mro__]
    if lightnings_own:
        kind = "" if lightnings_own[0] == cls.__name__ else f" (a Lightning {lightnings_own[0]})"
        raise ValueError(
            f"the precision plugin {cls.__name__}{kind} is not supported by ZeroStrategy: it takes Lightning's "
            f"Precision or MixedPrecision, or a subclass of them, with precision {allowed()}"
        )
    replaced = sorted({name for c in cls.__mro__ if c not in MixedPrecision.__mro__ for name in _STEP_METHODS
                       if name in vars(c)})
    if replaced:
        raise ValueError(
            f"the precision plugin {cls.__name__} overrides {', '.join(replaced)}, which ZeroStrategy's sharded step "
            "does itself (unscaling, the global norm and clipping over every rank's shards, the update): move that "
            "logic to LightningModule.configure_gradient_clipping or on_before_optimizer_step, or use "
            "MixedPrecision itself"
        )


def _is_lightning_class(cls: type) -> bool:
    return cls.__module__.split(".")[0] in ("lightning", "lightning_fabric", "pytorch_lightning")


@cache
def zero_class_for(cls: type[Precision]) -> type[ZeroPrecision]:
    """``ZeroPrecision``/``ZeroMixedPrecision`` for Lightning's plugins; for a user's subclass, a class of the same
    name deriving from it first (its overrides come first, its ``super()`` calls reach ours), then from ours."""
    zero = ZeroMixedPrecision if issubclass(cls, MixedPrecision) else ZeroPrecision
    if cls in (MixedPrecision, Precision):
        return zero
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                 "__reduce__": _reduce_user_plugin}
    return type(cls.__name__, (cls, zero), namespace)


def _reduce_user_plugin(plugin: ZeroPrecision) -> tuple[Any, ...]:
    """Pickled (the spawn launcher pickles the Trainer) as the user's class and the attributes: the class built for
    it has the user's name, so pickle could not find it by that name."""
    return _rebuild_user_plugin, (type(plugin).__mro__[1], plugin.__dict__)


def _rebuild_user_plugin(cls: type[Precision], state: dict[str, Any]) -> ZeroPrecision:
    plugin = object.__new__(zero_class_for(cls))
    plugin.__dict__.update(state)
    return plugin
