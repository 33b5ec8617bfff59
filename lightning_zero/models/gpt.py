"""A small decoder-only transformer (GPT-2 layout, pre-norm). Plain ``nn.Module``: it knows nothing of parallelism."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. ``tie_embeddings`` shares one matrix between the token embedding and the output head."""

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 128
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for field in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}={value!r} is invalid: it must be an integer >= 1")
        if self.d_model % self.n_head:
            raise ValueError(
                f"n_head={self.n_head} is invalid for d_model={self.d_model}: d_model must be a multiple of n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} is invalid: it must be in [0, 1)")

    @property
    def num_parameters(self) -> int:
        """Parameter count, tied matrices counted once (equals the built model's count; tests check it)."""
        d = self.d_model
        per_block = 12 * d * d + 13 * d  # qkv 3d²+3d, proj d²+d, mlp 8d²+5d, two LayerNorms 4d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.seq_len * d + self.n_layer * per_block + 2 * d + head

    def build(self) -> GPT:
        return GPT(self)


class Linear(nn.Linear):
    """``nn.Linear`` initialized as GPT-2 does (normal weights, zero bias), in ``reset_parameters()``.

    [Note: initialization in reset_parameters]
    Each layer draws its initial values in its own ``reset_parameters()``, called once at construction, and nowhere
    else. A model built on the meta device (e.g. by a ZeRO stage-3 strategy, which then calls ``reset_parameters()``
    module by module) is therefore initialized exactly as an eager build from the same seed.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = 0.02) -> None:
        self.std = std  # before nn.Linear.__init__, which calls reset_parameters()
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` initialized as GPT-2 does (see [Note: initialization in reset_parameters])."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = Linear(config.d_model, 3 * config.d_model)
        self.proj = Linear(config.d_model, config.d_model, std=_residual_std(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            Linear(config.d_model, 4 * config.d_model),
            nn.GELU(approximate="tanh"),
            Linear(4 * config.d_model, config.d_model, std=_residual_std(config)),
        )
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


def _residual_std(config: GPTConfig) -> float:
    """GPT-2 scales the init of the projections into the residual stream so its variance does not grow with depth."""
    return 0.02 / math.sqrt(2 * config.n_layer)


class GPT(nn.Module):
    """Token ids ``(batch, seq)`` -> next-token logits ``(batch, seq, vocab_size)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = Embedding(config.vocab_size, config.d_model)
        self.wpe = Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence length {seq} exceeds the model's seq_len={self.config.seq_len}")
        positions = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
