"""Small LightningModules for the Lightning-semantics tests: what ordinary Lightning code does (BatchNorm, channels_last
convolutions, float64 parameters, Lightning's GAN recipe with toggle_optimizer, BaseFinetuning, Adagrad, in-place
edits of weights), each run under DDP and under zero1/2/3 on the same data."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BaseFinetuning, Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def image_data(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 4, (n,), generator=g))


class ConvNet(pl.LightningModule):
    """Convolution, BatchNorm and a head; optionally channels_last weights, a float64 head, another optimizer."""

    def __init__(self, channels_last: bool = False, float64_head: bool = False, optimizer: str = "adamw") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # a bias before BatchNorm gets an exactly zero gradient
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)
        if channels_last:
            self.conv.to(memory_format=torch.channels_last)
            self.conv2.to(memory_format=torch.channels_last)
        self.float64_head = float64_head
        if float64_head:
            self.head.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        h = torch.relu(self.conv2(h)).mean(dim=(2, 3))
        return self.head(h.double() if self.float64_head else h).float()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        if self.optimizer_name == "adagrad":
            return torch.optim.Adagrad(self.parameters(), lr=0.05, initial_accumulator_value=0.1)
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(self.parameters())
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(image_data(), batch_size=4)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


class ToggleGAN(pl.LightningModule):
    """Lightning's GAN recipe: manual optimization with ``toggle_optimizer``/``untoggle_optimizer`` around each
    player's step, so the discriminator gets no gradient from the generator's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
        self.discriminator = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        noise, real = batch
        g_opt, d_opt = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        self.toggle_optimizer(g_opt)
        logits = self.discriminator(self.generator(noise))
        g_loss = bce(logits, torch.ones_like(logits))
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.toggle_optimizer(d_opt)
        fake = self.generator(noise).detach()
        real_logits, fake_logits = self.discriminator(real), self.discriminator(fake)
        d_loss = bce(real_logits, torch.ones_like(real_logits)) + bce(fake_logits, torch.zeros_like(fake_logits))
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999)),
        )

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        data = TensorDataset(torch.randn(128, 4, generator=g), torch.randn(128, 6, generator=g) * 0.5 + 1.0)
        return DataLoader(data, batch_size=4)


class Finetuned(pl.LightningModule):
    """A backbone trained only from epoch 1 on, and a head. ``reference=True`` keeps the backbone requiring grad
    (DDP reduces only what requires grad when it wraps) and adds it to the optimizer at epoch 1 itself."""

    def __init__(self, reference: bool = False) -> None:
        super().__init__()
        self.reference = reference
        self.backbone = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(torch.tanh(self.backbone(x))), y)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.zero_grad()  # the reference's backbone gets gradients it does not step yet

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.head.parameters()], lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(4)
        return DataLoader(TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)),
                          batch_size=4)


class UnfreezeAtEpoch1(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=1e-2, initial_denom_lr=1.0)


class AddBackboneAtEpoch1(Callback):
    """What ``UnfreezeAtEpoch1`` does to the optimizer, for the reference that never froze the backbone."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            trainer.optimizers[0].add_param_group({"params": list(pl_module.backbone.parameters()), "lr": 1e-2})


class Clamp(Callback):
    """Clamps every weight in place after each step (as weight clipping does), and records the largest weight each
    next step starts from."""

    def __init__(self, bound: float = 0.05) -> None:
        self.bound = bound
        self.largest: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        gathered = getattr(trainer.strategy, "gathered_parameters", None)
        with gathered() if gathered else torch.no_grad(), torch.no_grad():
            for param in pl_module.parameters():
                param.clamp_(-self.bound, self.bound)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        gathered = getattr(trainer.strategy, "gathered_parameters", None)
        with gathered() if gathered else torch.no_grad():
            self.largest.append(max(float(p.detach().abs().max()) for p in pl_module.parameters()))
