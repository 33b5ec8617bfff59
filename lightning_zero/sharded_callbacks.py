"""Lightning's own callbacks that keep or read whole weights, under stage 3: their copies of the model sharded like
the model, and whole weights where they need them.

[Note: Lightning's weight callbacks under zero3]
Three of Lightning's callbacks work on whole parameters between steps; under stage 3 a parameter holds its values only
while its unit is gathered. They run unchanged, each given what it needs:

* ``WeightAveraging`` / ``EMAWeightAveraging`` and ``StochasticWeightAveraging`` keep an average: a deep copy of the
  module made in their ``setup``, before the strategy shards it. ``shard_averages`` cuts that copy to this rank's rows
  as soon as the module is sharded (``UserView.shard_copy``: 4Ψ/N bytes per rank for an fp32 average instead of 4Ψ; on
  the host, or in a file, where an offload keeps the optimizer states). The callbacks then update, swap and transfer it
  through ``p.detach()`` and ``p.data``, which under stage 3 give this rank's rows of the parameters' values (the
  masters' rows: [Note: a parameter's values between its uses] in sharding/sharded_param.py), so every element is
  averaged, swapped in for validation and copied in at the end of fit with DDP's arithmetic, on the rank that holds it,
  with no communication. Their checkpoint entries (the average as ``state_dict``, SWA's ``average_model_state``) are
  this rank's rows, written into the one checkpoint file like the model's (checkpoint/hooks.py); a resume loads the
  file's full tensors into them, each rank keeping its rows. Buffers (BatchNorm's statistics) are whole on every rank,
  in the average as in the module.
* ``ModelPruning`` computes masks from whole weights (a global L1 threshold over every pruned parameter, or a top-k per
  parameter) and re-parametrizes them at the end of each epoch, and makes pruning permanent at the end of fit from
  ``weight_orig * weight_mask``. ``WholeWeights`` brackets those two hooks in the Trainer's callback list: the module is
  gathered just before them (``gathered_parameters()``) and sharded again just after, so pruning computes on DDP's
  values (in the working precision), and what it changed is taken back when the units reshard: the lottery-ticket reset rebinds
  ``weight_orig.data`` to the copy the callback made at setup, whose rows the master then aliases, as DDP's parameter
  aliases the copy (``ParamShard.take_rows``). That costs the whole model on every rank for the length of the hook, once
  an epoch. The masks are full-size buffers and the copies for the reset are whole, on every rank, as under DDP; a
  checkpoint made permanent by the callback (``on_save_checkpoint``) is computed from the values' rows, with no gather.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelPruning, StochasticWeightAveraging
from torch import Tensor, nn

from lightning_zero.sharding.runtime import ZeroRuntime
from lightning_zero.sharding.user_view import UserView

try:  # Lightning >= 2.5
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # pragma: no cover
    WeightAveraging = None


def adapt_weight_callbacks(trainer: pl.Trainer, runtime: ZeroRuntime, gathered: Any) -> None:
    """Under stage 3, at setup, once the module is sharded: the averages in rows, pruning on gathered weights (see
    [Note: Lightning's weight callbacks under zero3]); ``gathered`` is the strategy's ``gathered_parameters``."""
    keep = runtime.offload.keep_state_rows if runtime.offload is not None else Tensor.clone
    shard_averages(trainer, trainer.lightning_module, runtime.user_view, keep)
    bracket_whole_weights(trainer, gathered)


def shard_averages(trainer: pl.Trainer, module: nn.Module, user_view: UserView,
                   keep_rows: Callable[[Tensor], Tensor]) -> dict[str, int]:
    """Cut every weight-averaging callback's copy of ``module`` to this rank's rows, kept by ``keep_rows`` (where
    the offload keeps optimizer states, if any: see [Note: Lightning's weight callbacks under zero3]); returns the
    bytes each average's parameters hold now, by callback class."""
    held = {}
    for callback in trainer.callbacks:
        copy = _average_copy(callback)
        if copy is not None:
            held[type(callback).__name__] = user_view.shard_copy(copy, module.parameters(), keep_rows)
    return held


def _average_copy(callback: Callback) -> nn.Module | None:
    """The module a weight-averaging callback averages into, once its ``setup`` made it."""
    if WeightAveraging is not None and isinstance(callback, WeightAveraging):
        average = callback._average_model
        return average.module if average is not None else None
    if isinstance(callback, StochasticWeightAveraging):
        return callback._average_model
    return None


def bracket_whole_weights(trainer: pl.Trainer, gathered: Any) -> None:
    """Put a ``WholeWeights`` pair around every ``ModelPruning`` in the Trainer's callbacks (once): ``gathered`` is
    the strategy's ``gathered_parameters``."""
    callbacks = trainer.callbacks
    if any(isinstance(c, WholeWeights) for c in callbacks):
        return
    for callback in [c for c in callbacks if isinstance(c, ModelPruning)]:
        opening = WholeWeights(callback, gathered)
        position = callbacks.index(callback)
        callbacks[position : position + 1] = [opening, callback, opening.closing]


class WholeWeights(Callback):
    """Gathers the whole module before the hooks of ``callback`` that read whole weights (``ModelPruning``'s
    pruning and its making pruning permanent), and shards it again after them: placed just before ``callback`` in
    the Trainer's callback list, with its ``closing`` just after (see [Note: Lightning's weight callbacks under
    zero3])."""

    def __init__(self, callback: ModelPruning, gathered: Any) -> None:
        self.callback = callback
        self._gathered = gathered
        self._held = ExitStack()
        self.closing = _Closing(self)

    def _hooks(self) -> set[str]:
        pruning = self.callback
        hooks = {"on_train_epoch_end" if pruning._prune_on_train_epoch_end else "on_validation_epoch_end"}
        if pruning._make_pruning_permanent:
            hooks.add("on_train_end")
        return hooks

    def _open(self, hook: str, trainer: pl.Trainer) -> None:
        if hook in self._hooks() and not (hook == "on_validation_epoch_end" and trainer.sanity_checking):
            self._held.enter_context(self._gathered())

    def close(self) -> None:
        self._held.close()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._open("on_train_epoch_end", trainer)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._open("on_validation_epoch_end", trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._open("on_train_end", trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._held.pop_all()  # no collective after an error: the runtime's teardown frees what is held

    @property
    def state_key(self) -> str:
        return f"{type(self).__name__}[{self.callback.state_key}]"


class _Closing(Callback):
    """The end of a ``WholeWeights`` bracket."""

    def __init__(self, opening: WholeWeights) -> None:
        self._opening = opening

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._opening.close()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._opening.close()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._opening.close()

    @property
    def state_key(self) -> str:
        return f"{type(self).__name__}[{self._opening.callback.state_key}]"
