"""Checkpoints: one ``torch.save`` file per checkpoint that every rank writes its own rows into, read back by
each rank at any world size and stage, and loadable as a DDP checkpoint is.

``layout.py`` says what a checkpoint holds and what is checked; ``torch_file.py`` lays out and fills the file;
``sharded.py`` saves and loads it from the live shards; ``legacy.py`` loads checkpoint directories of the earlier
format; ``consolidate.py`` turns either into one file of weights (safetensors, or a Lightning checkpoint) in one
process.
"""

from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.checkpoint.layout import CheckpointError, is_checkpoint_directory, remove
from lightning_zero.checkpoint.sharded import model_tensors, open_checkpoint, optimizer_tensors, save_sharded

__all__ = [
    "CheckpointError",
    "consolidate",
    "is_checkpoint_directory",
    "model_tensors",
    "open_checkpoint",
    "optimizer_tensors",
    "remove",
    "save_sharded",
]
