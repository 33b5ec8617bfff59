"""The gate in front of user hooks while stage 1/2's parameter all-gathers are in flight (see [Note: the parameter
all-gather overlaps the next forward] in replicated.py).

Between the optimizer step and the next ``training_step`` Lightning runs user code: callbacks' and the
LightningModule's ``on_train_batch_end``, the next batch's transfer hooks and ``on_train_batch_start``. Any of it may
read parameters (an EMA callback does), and would see the previous step's rows. ``GatherGate`` is the first callback
of the Trainer, so its hooks run before everyone else's: it completes the gathers before ``on_train_batch_end`` unless
nothing that runs in that window can read a parameter, and always before hooks that run once per epoch or
evaluation. A callback that only reads metrics, timings or byte counts can say so with a class attribute
``reads_parameters = False``; Lightning's own progress bars, checkpointing (which waits itself), learning-rate
monitor, timer, summaries and early stopping are known not to read parameters in those hooks.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

#: Hooks that run between the optimizer step and the next ``training_step`` (or right around the step, before it).
WINDOW_HOOKS = ("on_train_batch_end", "on_train_batch_start", "on_before_zero_grad")
MODULE_WINDOW_HOOKS = (*WINDOW_HOOKS, "optimizer_zero_grad", "on_before_batch_transfer", "transfer_batch_to_device",
                       "on_after_batch_transfer")
#: Lightning callbacks whose window hooks read metrics, timings or the checkpoint path, never parameters.
_PARAMETER_FREE = ("ProgressBar", "ModelCheckpoint", "LearningRateMonitor", "Timer", "ModelSummary", "EarlyStopping",
                   "ThroughputMonitor", "GradientAccumulationScheduler", "ZeroMonitor")


class GatherGate(pl.Callback):
    """Completes in-flight parameter gathers before user hooks that may read parameters (see the module docstring)."""

    reads_parameters = False

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._window_reads: bool | None = None

    def _window_reads_parameters(self, trainer: pl.Trainer, module: pl.LightningModule) -> bool:
        if self._window_reads is None:
            callbacks = [c for c in trainer.callbacks if c is not self]
            self._window_reads = any(_may_read(c) for c in callbacks) or any(
                is_overridden(name, module, parent=pl.LightningModule) for name in MODULE_WINDOW_HOOKS
            )
        return self._window_reads

    def _wait_if_read(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self._window_reads_parameters(trainer, module):
            self.runtime.wait()

    def on_train_batch_end(self, trainer, pl_module, *_args) -> None:
        self._wait_if_read(trainer, pl_module)

    def on_before_zero_grad(self, trainer, pl_module, *_args) -> None:
        self._wait_if_read(trainer, pl_module)

    def _wait(self, *_args: Any) -> None:
        self.runtime.wait()

    on_train_epoch_start = on_train_epoch_end = on_train_end = on_fit_end = _wait
    on_validation_start = on_test_start = on_predict_start = on_save_checkpoint = _wait


def _may_read(callback: pl.Callback) -> bool:
    declared = getattr(type(callback), "reads_parameters", None)
    if declared is not None:
        return bool(declared)
    if any(base.__name__ in _PARAMETER_FREE for base in type(callback).__mro__):
        return False
    return any(is_overridden(name, callback, parent=pl.Callback) for name in WINDOW_HOOKS)


def install_gate(trainer: pl.Trainer, runtime: Any) -> None:
    """Make a ``GatherGate`` for ``runtime`` the Trainer's first callback (replacing one from an earlier setup)."""
    trainer.callbacks[:] = [GatherGate(runtime)] + [c for c in trainer.callbacks if not isinstance(c, GatherGate)]
