"""Which precision plugins ZeroStrategy takes, and how it refuses the others: the same error as DDP for the XLA
accelerator (Lightning's ``test_tpu_invalid_raises``, ``test_unsupported_tpu_choice``), a message naming the plugin
class for Lightning's other plugins, and a user's subclass kept (see [Note: the user's precision plugin]) unless it
overrides what the sharded step does itself. The runs under DDP and ZeRO are in
tests/distributed/test_precision_plugins.py."""

from __future__ import annotations

import pickle
import sys
from unittest.mock import Mock

import lightning.fabric as lf
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.accelerators import XLAAccelerator
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision, MixedPrecision, Precision, XLAPrecision
from lightning.pytorch.strategies import DDPStrategy

import lightning_zero  # noqa: F401  (registers the zero strategy names)
from lightning_zero import ZeroStrategy
from lightning_zero.precision import ZeroMixedPrecision, ZeroPrecision

XLA_REFUSED = "The `XLAAccelerator` can only be used with a `SingleDeviceXLAStrategy` or `XLAStrategy`, found "


@pytest.fixture
def tpu_available(monkeypatch):
    """8 TPU cores, mocked as Lightning's own tests mock them (tests_pytorch/conftest.py, mock_tpu_available)."""
    for module in (pl.strategies.xla, pl.strategies.single_xla, pl.plugins.precision.xla, pl.strategies.launchers.xla,
                   lf.accelerators.xla, lf.plugins.environments.xla, lf.plugins.io.xla, lf.strategies.launchers.xla):
        monkeypatch.setattr(module, "_XLA_AVAILABLE", True)
    for accelerator in (pl.accelerators.xla.XLAAccelerator, lf.accelerators.xla.XLAAccelerator):
        monkeypatch.setattr(accelerator, "is_available", lambda: True)
        monkeypatch.setattr(accelerator, "auto_device_count", lambda *_: 8)
    for name in ("torch_xla", "torch_xla.core.xla_model", "torch_xla.experimental"):
        monkeypatch.setitem(sys.modules, name, Mock())


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_the_xla_accelerator_is_refused_as_under_ddp(tpu_available, strategy: str) -> None:
    # Lightning picks XLAPrecision for the TPU; the error names the accelerator under both, not the plugin.
    with pytest.raises(ValueError, match=f"^{XLA_REFUSED}"):
        pl.Trainer(accelerator="tpu", precision="16-true", strategy=strategy)


def test_a_strategy_given_the_xla_accelerator_is_refused_with_ddps_error(tpu_available) -> None:
    ddp = DDPStrategy(accelerator=XLAAccelerator(), precision_plugin=XLAPrecision())
    with pytest.raises(ValueError, match=f"^{XLA_REFUSED}DDPStrategy"):
        pl.Trainer(strategy=ddp, devices=8)
    with pytest.raises(ValueError, match=f"^{XLA_REFUSED}ZeroStrategy, which runs on 'cpu' and 'cuda' accelerators"):
        ZeroStrategy(stage=2, accelerator=XLAAccelerator(), precision_plugin=XLAPrecision())  # refused when built


@pytest.mark.parametrize("plugin", [FSDPPrecision("32-true"), DeepSpeedPrecision("32-true")])
def test_lightnings_other_plugins_are_refused_naming_the_class(plugin: Precision) -> None:
    name = type(plugin).__name__
    with pytest.raises(ValueError, match=f"^the precision plugin {name} is not supported by ZeroStrategy: it takes "
                       "Lightning's Precision or MixedPrecision, or a subclass of them, with precision '32-true', "
                       "'bf16-mixed', '16-mixed'$"):
        ZeroStrategy(stage=2, precision_plugin=plugin)


class OwnStep(MixedPrecision):
    def optimizer_step(self, optimizer, model, closure, **kwargs):
        return super().optimizer_step(optimizer, model, closure, **kwargs)


class OwnClip(Precision):
    def clip_grad_by_norm(self, optimizer, clip_val):
        pass


@pytest.mark.parametrize("plugin,methods", [(OwnStep("bf16-mixed", "cpu"), "optimizer_step"),
                                            (OwnClip(), "clip_grad_by_norm")])
def test_a_plugin_overriding_the_sharded_steps_work_is_refused_naming_the_method(plugin, methods: str) -> None:
    with pytest.raises(ValueError, match=f"^the precision plugin {type(plugin).__name__} overrides {methods}, which "
                       "ZeroStrategy's sharded step does itself"):
        ZeroStrategy(stage=1, precision_plugin=plugin)


class UserAMP(MixedPrecision):
    def __init__(self) -> None:
        super().__init__("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
        self.note = "kept"


class UserFull(Precision):
    pass


def test_a_users_plugin_is_kept_as_its_own_class_and_pickles_for_the_spawn_launcher() -> None:
    plugin = UserAMP()
    strategy = ZeroStrategy(stage=3, precision_plugin=plugin)
    assert strategy.precision_plugin is plugin
    assert type(plugin).__name__ == type(plugin).__qualname__ == "UserAMP"
    assert type(plugin).__mro__[1:4] == (UserAMP, ZeroMixedPrecision, ZeroPrecision)
    assert plugin.working_dtype == torch.float16 and plugin.note == "kept" and plugin.scaler.get_scale() == 2.0**10
    copy = pickle.loads(pickle.dumps(strategy)).precision_plugin
    assert type(copy) is type(plugin)  # the class built for UserAMP, once per class
    assert copy.note == "kept" and copy.working_dtype == torch.float16 and copy.scaler.get_scale() == 2.0**10
    full = ZeroStrategy(stage=1, precision_plugin=UserFull()).precision_plugin
    assert isinstance(full, UserFull) and isinstance(full, ZeroPrecision) and not isinstance(full, MixedPrecision)
    assert full.scaler is None and full.working_dtype is None
