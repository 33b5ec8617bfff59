"""A real text corpus present on every machine with no download: the Python standard library's own source files.

Byte-level tokens (vocabulary 256, no tokenizer to ship), cut into fixed-length windows. The corpus is deterministic
for a given Python installation: files are ordered by a hash of their path relative to the standard library (a stable
shuffle, so that the validation split is not just the alphabetically last modules), read until ``max_bytes``, joined,
and the last ``val_fraction`` of the bytes is the validation split. Another Python version gives another corpus.
"""

from __future__ import annotations

import math
import sysconfig
import zlib
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

VOCAB_SIZE = 256
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` (installed packages excluded), in a stable pseudo-random order."""
    files = [
        path
        for path in root.rglob("*.py")
        if not _EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1]) and path.is_file()
    ]
    return sorted(files, key=lambda p: (zlib.crc32(p.relative_to(root).as_posix().encode()), p.as_posix()))


def load_corpus(root: Path, max_bytes: int) -> bytes:
    """Up to ``max_bytes`` bytes of source, whole files joined by a blank line (the last one cut at the limit)."""
    chunks, size = [], 0
    for path in source_files(root):
        text = path.read_bytes() + b"\n\n"
        chunks.append(text[: max_bytes - size])
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    return b"".join(chunks)


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len`` inputs, each paired with the same window shifted by one token."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


class StdlibCorpus(pl.LightningDataModule):
    """Byte-level language-modelling data from the standard library's ``.py`` files.

    Args:
        seq_len: tokens per training example (the model's context length).
        batch_size: examples per batch on each rank.
        max_bytes: how much source to read; bounds loading time and memory (2 MB loads in well under a second).
        val_fraction: share of the bytes held out for validation, taken from the end of the corpus.
        root: directory to read instead of the standard library (any tree of ``.py`` files).
    """

    def __init__(
        self,
        seq_len: int = 128,
        batch_size: int = 16,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        root: str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} is invalid: it must be in (0, 1)")
        smallest_split = min(val_fraction, 1.0 - val_fraction)
        if max_bytes * smallest_split < seq_len + 1:
            raise ValueError(
                f"max_bytes={max_bytes} is too small for seq_len={seq_len} and val_fraction={val_fraction}: "
                f"it must be at least {math.ceil((seq_len + 1) / smallest_split)}"
            )
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.root = Path(root) if root is not None else stdlib_root()
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        corpus = load_corpus(self.root, self.max_bytes)
        tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        split = int(len(tokens) * (1.0 - self.val_fraction))
        self.train_set = TokenWindows(tokens[:split], self.seq_len)
        self.val_set = TokenWindows(tokens[split:], self.seq_len)
        for name, dataset in (("train", self.train_set), ("validation", self.val_set)):
            if len(dataset) == 0:
                raise ValueError(
                    f"max_bytes={self.max_bytes} is too small: the {name} split of {self.root} holds no window of "
                    f"seq_len={self.seq_len} tokens"
                )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
