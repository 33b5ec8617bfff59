"""Next-token language modelling as a LightningModule, for any network a small config dataclass can build.

The network is built in ``configure_model`` (not ``__init__``) so that a strategy can build it under its own context,
e.g. on the meta device or straight into shards, and so that no rank ever holds a full copy it does not need.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity


class ModelConfig(Protocol):
    """What ``LanguageModel`` needs from a model config: a network mapping token ids to next-token logits."""

    def build(self) -> nn.Module: ...


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    trainable: int


class LanguageModel(pl.LightningModule):
    """Trains ``model_config.build()`` on ``(inputs, targets)`` token batches with AdamW and warmup + cosine decay.

    Args:
        model_config: builds the network (``GPTConfig``, ``HFModelConfig``, ...).
        lr: peak learning rate, reached after ``warmup_steps`` and decayed to ``lr * min_lr_ratio`` at the last step.
        weight_decay: applied to matrices and embeddings only, never to biases and norm weights.
        frozen: parameter-name prefixes (as in ``network.named_parameters()``) to freeze, e.g. ``("wte",)``.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        frozen: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        if not lr > 0:
            raise ValueError(f"lr={lr!r} is invalid: it must be > 0")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} is invalid: it must be >= 0")
        # The config goes to the loggers as a plain dict (Lightning cannot log a frozen dataclass); restoring from a
        # checkpoint therefore takes it again: ``LanguageModel.load_from_checkpoint(path, model_config=...)``.
        self.save_hyperparameters(
            {
                "model_config": _describe(model_config),
                "lr": lr,
                "weight_decay": weight_decay,
                "warmup_steps": warmup_steps,
                "min_lr_ratio": min_lr_ratio,
                "betas": tuple(betas),
                "frozen": tuple(frozen),
            }
        )
        self.model_config = model_config
        self.frozen = tuple(frozen)
        self.model: nn.Module | None = None
        #: Unsharded parameter counts, taken when the network is built (before any strategy shards it).
        self.num_parameters: int | None = None
        self.num_trainable_parameters: int | None = None
        self.val_loss = MeanMetric()
        self.val_ppl = Perplexity()

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning may call this more than once (fit, then validate or test)
            return
        network = self.model_config.build()
        _freeze(network, self.frozen)
        counts = _count(network)
        self.model = network
        self.num_parameters, self.num_trainable_parameters = counts.total, counts.trainable

    def parameter_counts(self) -> ParameterCounts:
        """Unsharded parameter counts without allocating anything: builds a throwaway copy on the meta device."""
        with torch.device("meta"):
            network = self.model_config.build()
        _freeze(network, self.frozen)
        return _count(network)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = _next_token_loss(self(inputs), targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        logits = self(inputs).float()
        self.val_loss.update(_next_token_loss(logits, targets), weight=targets.numel())
        self.val_ppl.update(logits, targets)
        self.log("val_loss", self.val_loss, prog_bar=True)
        self.log("val_ppl", self.val_ppl, prog_bar=True)

    def configure_optimizers(self) -> dict:
        decay, no_decay = [], []
        for param in self.parameters():
            if param.requires_grad:
                (decay if param.ndim >= 2 else no_decay).append(param)
        groups = [
            {"params": params, "weight_decay": wd}
            for params, wd in ((decay, self.hparams.weight_decay), (no_decay, 0.0))
            if params
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=tuple(self.hparams.betas))
        total_steps = self.trainer.max_steps if self.trainer.max_steps > 0 else self.trainer.estimated_stepping_batches
        schedule = partial(
            warmup_cosine,
            warmup_steps=self.hparams.warmup_steps,
            total_steps=int(total_steps),
            min_ratio=self.hparams.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR: linear warmup over ``warmup_steps``, then cosine decay to ``min_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _freeze(network: nn.Module, prefixes: tuple[str, ...]) -> None:
    names = [name for name, _ in network.named_parameters()]
    for prefix in prefixes:
        if not any(_under(name, prefix) for name in names):
            tops = sorted({name.split(".")[0] for name in names})
            raise ValueError(
                f"frozen={prefix!r} matches no parameter: parameter names start with {', '.join(tops)}"
            )
    for name, param in network.named_parameters():
        if any(_under(name, prefix) for prefix in prefixes):
            param.requires_grad_(False)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _count(network: nn.Module) -> ParameterCounts:
    params = list(network.parameters())  # named_parameters/parameters yield a tied parameter once
    return ParameterCounts(
        total=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
    )


def _describe(model_config: object) -> object:
    if dataclasses.is_dataclass(model_config):
        return {"class": type(model_config).__qualname__, **dataclasses.asdict(model_config)}
    return repr(model_config)
