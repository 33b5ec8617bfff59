"""Data modules that need no download."""

from lightning_zero.data.corpus import VOCAB_SIZE, StdlibCorpus, TokenWindows

__all__ = ["VOCAB_SIZE", "StdlibCorpus", "TokenWindows"]
