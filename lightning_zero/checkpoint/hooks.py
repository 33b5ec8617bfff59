"""ZeroStrategy's checkpoint hooks: Lightning's ``Strategy`` methods that save and load, answered with one checkpoint
file that every rank writes its rows into (``sharded.py``) and from which every rank reads only its rows; checkpoint
directories of the earlier format (``legacy.py``) still load.

A mixin placed before ``DDPStrategy`` in ``ZeroStrategy``'s bases; it uses the strategy's ``runtime``, ``config``,
``precision_plugin``, ``optimizers`` and ``world_size``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from lightning_zero.checkpoint.layout import FORMAT_KEY, is_checkpoint_directory, remove, state_dict_keys
from lightning_zero.checkpoint.legacy import load_directory
from lightning_zero.checkpoint.sharded import (
    check_model,
    check_optimizer_states,
    format_info,
    model_tensors,
    open_checkpoint,
    optimizer_tensors,
    rows_as_dtensors,
    save_sharded,
    verify_rows,
)
from lightning_zero.precision import ZeroMixedPrecision


class ShardedCheckpointHooks:
    """Save and load through the shards (see the module docstring)."""

    _device_mesh: Any = None
    _loaded_directory: bool = False
    _optimizer_classes: list[str] | None = None

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints are loaded into the shards, so after they exist."""
        return True

    def _mesh(self):
        if self._device_mesh is None:
            self._device_mesh = self.runtime.comms.device_mesh()
        return self._device_mesh

    def _holds_shards(self) -> bool:
        """Whether this process trains the shards. The process that started spawned ranks never does: after ``fit``
        it holds the full weights rank 0 sent back, and saves and loads them as DDP would (one file, from rank 0)."""
        return self._runtime is not None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state_dict with this rank's shards as DTensors of the full shapes: no communication (see
        ``sharded.py``)."""
        if not self._holds_shards():
            return super().lightning_module_state_dict()
        self.runtime.wait()
        return model_tensors(self.runtime.module, self.runtime.shards, self._mesh())

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state_dict with this rank's shards of its per-element state as DTensors."""
        if not self._holds_shards():
            return super().optimizer_state(optimizer)
        return optimizer_tensors(self.runtime.sharded(_unwrap(optimizer)), self._mesh())

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write the checkpoint file, every rank its own rows in parallel, atomically (see ``sharded.py``)."""
        if not self._holds_shards():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("ZeroStrategy writes checkpoint files itself, from every rank; storage_options is not used")
        runtime = self.runtime
        runtime.check_offloaded_files()
        runtime.adopt_edits()
        rows_as_dtensors(checkpoint, self._mesh(), runtime.comms.rank, runtime.comms.world_size)
        optimizers = [runtime.sharded(_unwrap(o)) for o in self.optimizers]  # as Lightning lists optimizer_states
        facts = {
            "stage": self.config.stage,
            "world_size": runtime.comms.world_size,  # the ranks that wrote rows: one shard group's under hybrid sharding
            "precision": self.precision_plugin.precision,
            "optimizer_classes": [type(o.optimizer).__name__ for o in optimizers],
        }
        optimizer_shapes = [[s.spec.shape for s in o.shards] for o in optimizers]
        plugin = self.precision_plugin
        if type(plugin) is ZeroMixedPrecision and type(plugin).__qualname__ in checkpoint:
            # the loss scaler's state where DDP's MixedPrecision plugin looks for it (ours reads it there too); a
            # user's plugin class keeps its own name, as under DDP
            checkpoint[MixedPrecision.__qualname__] = checkpoint.pop(type(plugin).__qualname__)
        save_sharded(filepath, checkpoint, facts, self._parameter_shapes(), optimizer_shapes, runtime.comms)
        runtime.release_offloaded_pages()

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Map a checkpoint file (ours, DDP's, one device's, ``consolidate``'s), check it against the model and the
        optimizers on every rank, and hand it to Lightning; the model and optimizer state are then copied in, each
        rank reading only its rows. A checkpoint directory (the earlier format) is read straight into the shards."""
        if not self._holds_shards():
            return super().load_checkpoint(checkpoint_path, weights_only)
        runtime = self.runtime
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        optimizers = [runtime.sharded(o) for o in self.optimizers] if fitting else []
        self._loaded_directory = is_checkpoint_directory(checkpoint_path)
        if self._loaded_directory:
            meta = load_directory(
                checkpoint_path, runtime.module, runtime.shards, optimizers, self._mesh(), runtime.comms
            )
            runtime.refresh_full_parameters()
            return meta
        checkpoint = open_checkpoint(checkpoint_path, weights_only)
        info = format_info(checkpoint)
        if info is not None:
            verify_rows(Path(checkpoint_path), checkpoint, runtime.comms, optimizer_states=bool(optimizers))
        #: Checked against the model when it is loaded into it, after ``on_load_checkpoint`` (where user code may
        #: migrate the checkpoint: rename keys, drop a head), as DDP's load sees it.
        self._optimizer_classes = info.get("optimizer_classes") if info is not None else None
        checkpoint.pop(FORMAT_KEY, None)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Check the checkpoint (as ``on_load_checkpoint`` left it) against the model and, when fitting, the
        optimizers, on every rank before anything is loaded; then copy each rank's rows into its shards."""
        if not self._holds_shards():
            return super().load_model_state_dict(checkpoint, strict=strict)
        if self._loaded_directory:
            return
        check_model(checkpoint["state_dict"], self._state_dict_shapes(), strict)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and checkpoint.get("optimizer_states"):
            optimizers = [self.runtime.sharded(_unwrap(o)) for o in self.optimizers]
            check_optimizer_states(checkpoint["optimizer_states"], optimizers, self._optimizer_classes)
        self.runtime.load_full_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._holds_shards():
            return super().load_optimizer_state_dict(checkpoint)
        if self._loaded_directory:
            self._loaded_directory = False
            return
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            self.runtime.sharded(optimizer).load_consolidated_state_dict(state)

    def _parameter_shapes(self) -> dict[str, torch.Size]:
        """Every parameter's full shape by state_dict key, tied weights under each of their names."""
        shapes = {s.name: s.spec.shape for s in self.runtime.shards}
        _, aliases = state_dict_keys(self.runtime.module)
        shapes.update({alias: shapes[first] for alias, first in aliases.items() if first in shapes})
        return shapes

    def _state_dict_shapes(self) -> dict[str, torch.Size]:
        """The full shape of every tensor in the module's state_dict (parameters and persistent buffers)."""
        shapes = self._parameter_shapes()
        for name, value in self.runtime.module.state_dict(keep_vars=True).items():
            if name not in shapes and torch.is_tensor(value):
                shapes[name] = value.shape
        return shapes


def _unwrap(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
