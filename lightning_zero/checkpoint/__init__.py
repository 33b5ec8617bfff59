"""Sharded checkpoints: torch.distributed.checkpoint directories keyed by parameter name, resharded on load.

``layout.py`` says what a checkpoint directory holds and checks one before anything is read; ``sharded.py`` saves and
loads it from the live shards (every rank its own rows); ``consolidate.py`` turns it into one file that plain PyTorch
loads, in one process.
"""

from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.checkpoint.layout import CheckpointError, is_sharded_checkpoint, remove
from lightning_zero.checkpoint.sharded import load_sharded, model_tensors, optimizer_tensors, save_sharded

__all__ = [
    "CheckpointError",
    "consolidate",
    "is_sharded_checkpoint",
    "load_sharded",
    "model_tensors",
    "optimizer_tensors",
    "remove",
    "save_sharded",
]
