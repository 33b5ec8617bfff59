"""The byte count behind benchmarks/activation_memory.py: what a forward leaves alive for backward."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from activation_memory import held_for_backward  # noqa: E402

from lightning_zero.lightning_compat import apply_activation_checkpointing  # noqa: E402


def test_only_what_backward_needs_is_counted() -> None:
    # Linear -> ReLU: the Linear's output is freed once ReLU has run (ReLU saves its own output, the Linear its
    # input, which existed before), so exactly one (8, 32) fp32 tensor stays alive besides the returned sum.
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    x = torch.randn(8, 16)
    held, out = held_for_backward(lambda: model(x).sum())
    assert held == 8 * 32 * 4
    out.backward()


class Block(nn.Sequential):
    pass


def test_checkpointing_keeps_only_block_inputs() -> None:
    blocks = nn.Sequential(*(Block(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)))
    x = torch.randn(8, 16, requires_grad=True)
    plain, _ = held_for_backward(lambda: blocks(x).sum())
    apply_activation_checkpointing(blocks, ("Block",))
    held, out = held_for_backward(lambda: blocks(x).sum())
    # Per block, the first Linear's and the GELU's outputs (8x64 each) are saved for backward, and the outputs
    # (8x16) of the first two blocks are the next blocks' inputs (the sum saves nothing of the last one's).
    # Checkpointed, only those block inputs stay; the rest is recomputed in backward.
    assert plain == 3 * 2 * 8 * 64 * 4 + 2 * 8 * 16 * 4
    assert held == 2 * 8 * 16 * 4
    out.backward()
