"""Small models, data and recorders shared by the distributed and integration tests."""

from __future__ import annotations

import contextlib
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


def pattern_loader(vocab_size: int, seq_len: int, rows: int) -> DataLoader:
    """``rows`` learnable sequences, batches of 4: token ``t`` of a row is ``(a + b t) mod vocab_size``."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, vocab_size, (rows, 1), generator=g)
    b = torch.randint(1, 8, (rows, 1), generator=g)
    tokens = (a + b * torch.arange(seq_len + 1)) % vocab_size
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


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
        gathered = getattr(trainer.strategy, "gathered_parameters", contextlib.nullcontext)
        with gathered():
            self.params.append(flat_params(pl_module))


def make_trainer(strategy, world_size: int, max_steps: int = 10, callbacks=(), **kwargs) -> pl.Trainer:
    settings = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    ) | kwargs
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size,
        max_steps=max_steps,
        callbacks=list(callbacks),
        **settings,
    )


class TinyLM(pl.LightningModule):
    """A decoder-only language model with tied input/output embeddings, built in ``configure_model``."""

    def __init__(self, vocab: int = VOCAB, d_model: int = 16, n_layer: int = 2, optimizer: str = "adamw") -> None:
        super().__init__()
        self.vocab, self.d_model, self.n_layer, self.optimizer_name = vocab, d_model, n_layer, optimizer
        self.lm = None

    def configure_model(self) -> None:
        if self.lm is not None:
            return
        self.lm = nn.ModuleDict(
            {
                "wte": nn.Embedding(self.vocab, self.d_model),
                "wpe": nn.Embedding(SEQ, self.d_model),
                "blocks": nn.ModuleList(Block(self.d_model, n_head=2) for _ in range(self.n_layer)),
                "ln_f": nn.LayerNorm(self.d_model),
                "head": nn.Linear(self.d_model, self.vocab, bias=False),
            }
        )
        self.lm["head"].weight = self.lm["wte"].weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.lm["wte"](tokens) + self.lm["wpe"](torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.lm["blocks"]:
            x = block(x)
        return self.lm["head"](self.lm["ln_f"](x))

    def training_step(self, batch, batch_idx):
        tokens, _ = batch
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))

    def validation_step(self, batch, batch_idx):
        tokens, _ = batch
        logits = self(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self(batch[0][:, :-1]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(token_dataset(), batch_size=4, shuffle=False)

    def val_dataloader(self):
        return DataLoader(token_dataset(64, seed=1), batch_size=4, shuffle=False)

    test_dataloader = val_dataloader
    predict_dataloader = val_dataloader


class LoRALinear(nn.Module):
    """A frozen base projection plus a trainable low-rank update: frozen and trainable parameters in one module."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


class AdapterModel(pl.LightningModule):
    """A frozen embedding sub-module, two LoRA layers, one module called twice in a forward, a trainable head."""

    def __init__(self, d_model: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.embed.requires_grad_(False)
        self.adapt1 = LoRALinear(d_model, d_model)
        self.adapt2 = LoRALinear(d_model, d_model)
        self.mix = nn.Linear(d_model, d_model)
        self.head = nn.Linear(d_model, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = torch.tanh(self.mix(h))
        h = h + self.adapt1(h)
        h = torch.tanh(self.mix(h))  # the same module, a second time
        h = h + self.adapt2(h)
        return self.head(h.mean(dim=1))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(token_dataset(), batch_size=4, shuffle=False)


class TinyGAN(pl.LightningModule):
    """Manual optimization with two optimizers, as a GAN's generator and discriminator."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
        self.discriminator = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        noise, real = batch
        g_opt, d_opt = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        fake = self.generator(noise)
        real_logits, fake_logits = self.discriminator(real), self.discriminator(fake.detach())
        d_loss = bce(real_logits, torch.ones_like(real_logits)) + bce(fake_logits, torch.zeros_like(fake_logits))
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        logits = self.discriminator(fake)
        g_loss = bce(logits, torch.ones_like(logits))
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.losses += [float(d_loss), float(g_loss)]

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999)),
        )

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        data = TensorDataset(torch.randn(256, 4, generator=g), torch.randn(256, 6, generator=g) * 0.5 + 1.0)
        return DataLoader(data, batch_size=4)


class StepSeededLM(TinyLM):
    """TinyLM whose batch is drawn from (global step, rank): a resumed run sees exactly the data of an uninterrupted
    one, whatever Lightning's dataloader does on resume."""

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
        tokens = torch.randint(0, self.vocab, (4, SEQ), generator=g).to(self.device)
        return super().training_step((tokens, None), batch_idx)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
