"""ZeroStrategy's checkpoint hooks: Lightning's ``Strategy`` methods that save and load, answered with sharded
``torch.distributed.checkpoint`` directories (``sharded.py``) and, for single-file checkpoints (DDP, one device,
``consolidate``), with the full state dict scattered into the shards.

A mixin placed before ``DDPStrategy`` in ``ZeroStrategy``'s bases; it uses the strategy's ``runtime``, ``config``,
``precision_plugin``, ``optimizers`` and ``world_size``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from lightning_zero.checkpoint.layout import is_sharded_checkpoint, remove
from lightning_zero.checkpoint.sharded import load_sharded, model_tensors, optimizer_tensors, save_sharded


class ShardedCheckpointHooks:
    """Save and load through the shards (see the module docstring)."""

    _device_mesh: Any = None
    _loaded_sharded: bool = False

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints are loaded into the shards, so after they exist."""
        return True

    def _mesh(self):
        if self._device_mesh is None:
            self._device_mesh = self.runtime.comms.device_mesh()
        return self._device_mesh

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's shards as DTensors, keyed by parameter name: no communication (see ``sharded.py``)."""
        self.runtime.wait()
        return model_tensors(self.runtime.module, self.runtime.shards, self._mesh(), self.runtime.comms.rank)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's optimizer state shards, keyed by parameter name."""
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return optimizer_tensors(self.runtime.sharded(inner), self._mesh())

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint directory, every rank in parallel, atomically (see ``sharded.py``)."""
        if storage_options is not None:
            raise TypeError("ZeroStrategy writes torch.distributed.checkpoint directories; storage_options is not used")
        facts = {"stage": self.config.stage, "world_size": self.world_size, "precision": self.precision_plugin.precision}
        self.runtime.check_offloaded_files()
        self.runtime.adopt_edits()
        save_sharded(filepath, checkpoint, self.runtime.module, self.runtime.shards, facts, self.runtime.comms)
        self.runtime.release_offloaded_pages()

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint directory is read straight into the shards, each rank reading only its rows (at any
        world size and stage); a single-file checkpoint (DDP, single device, ``consolidate``) loads as usual."""
        self._loaded_sharded = is_sharded_checkpoint(checkpoint_path)
        if not self._loaded_sharded:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        runtime = self.runtime
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        sharded = [runtime.sharded(o) for o in self.optimizers] if fitting else []
        meta = load_sharded(checkpoint_path, runtime.module, runtime.shards, sharded, self._mesh(), runtime.comms)
        runtime.refresh_full_parameters()
        return meta

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._loaded_sharded:
            return
        self.runtime.load_full_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._loaded_sharded:
            self._loaded_sharded = False
            return
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            self.runtime.sharded(optimizer).load_consolidated_state_dict(state)
