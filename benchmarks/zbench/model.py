"""The one model and data set every approach trains: a pre-norm GPT on learnable synthetic token sequences.

The model is self-contained (it does not import ``lightning_zero.models``) so that the benchmark measures the same
network whatever happens to the package's model zoo. Its forward returns the loss, so DeepSpeed's engine, FSDP2 and
the Lightning module all call it the same way. Transformer blocks are instances of ``Block``: FSDP2 shards each one
with ``fully_shard`` and lightning_zero's stage 3 gathers each one as a unit (``units=("Block",)``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelSize:
    name: str
    vocab: int
    d_model: int
    n_layer: int
    n_head: int
    seq: int

    @property
    def n_params(self) -> int:
        d = self.d_model
        per_block = 12 * d * d + 13 * d  # qkv 3d^2+3d, proj d^2+d, fc1 4d^2+4d, fc2 4d^2+d, two LayerNorms 4d
        return 2 * self.vocab * d + self.seq * d + self.n_layer * per_block + 2 * d

    def as_dict(self) -> dict:
        return asdict(self)


SIZES = {
    "tiny": ModelSize("tiny", vocab=512, d_model=64, n_layer=2, n_head=2, seq=64),  # --quick only
    "S": ModelSize("S", vocab=8192, d_model=128, n_layer=4, n_head=4, seq=128),
    "M": ModelSize("M", vocab=8192, d_model=256, n_layer=8, n_head=8, seq=128),
    "L": ModelSize("L", vocab=8192, d_model=512, n_layer=8, n_head=8, seq=128),
}


def long_sequence(size: ModelSize, seq: int) -> ModelSize:
    return replace(size, name=f"{size.name}-seq{seq}", seq=seq)


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class BenchGPT(nn.Module):
    """Token ids and next-token targets ``(batch, seq)`` -> mean cross-entropy (a scalar)."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.tok = nn.Embedding(size.vocab, size.d_model)
        self.pos = nn.Embedding(size.seq, size.d_model)
        self.blocks = nn.ModuleList(Block(size.d_model, size.n_head) for _ in range(size.n_layer))
        self.ln_f = nn.LayerNorm(size.d_model)
        self.head = nn.Linear(size.d_model, size.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def compile_model(model: BenchGPT, scope: str, backend: str = "inductor") -> None:
    """torch.compile in place: each Block (``scope="blocks"``) or the whole model (``"model"``); compiled on the
    first step, which the warm-up covers."""
    for module in model.blocks if scope == "blocks" else [model]:
        module.compile(backend=backend)


def build_model(size: ModelSize, seed: int = 0) -> BenchGPT:
    """The same initial weights on every rank and for every approach."""
    torch.manual_seed(seed)
    return BenchGPT(size)


def make_batches(size: ModelSize, batch: int, steps: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``batch`` sequences for ``rank``: each sequence counts up from a random start with a
    random stride, modulo ``DATA_TOKENS`` (a small band of the vocabulary). The loss falls by about 0.4 per step
    from ln(vocab), so an approach whose updates are wrong or stale shows in the losses after a few steps."""
    out = []
    band = min(size.vocab, DATA_TOKENS)
    for step in range(steps):
        gen = torch.Generator().manual_seed(104_729 * (step + 1) + 7_919 * rank)
        start = torch.randint(0, band, (batch, 1), generator=gen)
        stride = torch.randint(1, 13, (batch, 1), generator=gen)
        tokens = (start + stride * torch.arange(size.seq + 1)) % band
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


DATA_TOKENS = 97
OPTIMIZER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_optimizer(params) -> torch.optim.Optimizer:
    """AdamW (torch's default implementation on CPU: foreach) with the same hyper-parameters everywhere."""
    return torch.optim.AdamW(params, **OPTIMIZER)
