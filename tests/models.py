"""Small models, data and recorders shared by the distributed and integration tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, CLASSES, SEQ = 11, 5, 6


class Block(nn.Module):
    """A pre-LayerNorm transformer block. The query/key/value projection has no bias: a key bias gets an exactly
    zero gradient (softmax is shift-invariant), and Adam turns the float noise in that zero into lr-sized steps whose
    sign depends on summation order, so no two all-reduce algorithms could agree on it."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 3 * d_model), nn.GELU(), nn.Linear(3 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class ParityModel(pl.LightningModule):
    """Several parameter shapes: an embedding with 11 rows (padded at 2 and 4 ranks), a transformer block, a 5-row
    head, a 0-d scale and, optionally, a layer used only on even batches."""

    def __init__(self, optimizer: str = "adamw", d_model: int = 16, with_unused: bool = False) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.with_unused = with_unused
        self.embed = nn.Embedding(VOCAB, d_model)
        self.block = Block(d_model, n_head=2)
        self.sometimes = nn.Linear(d_model, d_model) if with_unused else None
        self.head = nn.Linear(d_model, CLASSES)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, tokens: torch.Tensor, use_sometimes: bool = False) -> torch.Tensor:
        hidden = self.block(self.embed(tokens)).mean(dim=1)
        if use_sometimes:
            hidden = hidden + self.sometimes(hidden)
        return self.head(hidden) * self.scale

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self(tokens, use_sometimes=self.with_unused and batch_idx % 2 == 0)
        return nn.functional.cross_entropy(logits, targets)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if self.optimizer_name == "groups_sched":
            first = list(self.embed.parameters()) + list(self.block.parameters())
            rest = [p for n, p in self.named_parameters() if not n.startswith(("embed.", "block."))]
            optimizer = torch.optim.AdamW(
                [{"params": first, "lr": 1e-2, "weight_decay": 0.1}, {"params": rest, "lr": 3e-3, "weight_decay": 0.0}]
            )
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        raise ValueError(self.optimizer_name)

    def train_dataloader(self):
        return DataLoader(token_dataset(), batch_size=4, shuffle=False)


def token_dataset(n: int = 512, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


@dataclass
class Recorder(pl.Callback):
    """Loss and all parameters after every optimizer step, as this rank sees them."""

    losses: list[float] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if trainer.fit_loop._should_accumulate():
            return
        self.params.append(flat_params(pl_module))


def make_trainer(strategy, world_size: int, max_steps: int = 10, callbacks=(), **kwargs) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size,
        max_steps=max_steps,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
