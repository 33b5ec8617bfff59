"""The checkpoint path Lightning hands out is a file that loads as DDP's does: the same LightningModule trained
under ``strategy="ddp"`` and under zero1, zero2 and zero3 (2 CPU ranks) with ``ModelCheckpoint``, then, as a user
does after training, ``Net.load_from_checkpoint(best_model_path)`` and ``torch.load(best_model_path)`` (with its
default ``weights_only=True``, also in a process without lightning_zero) give DDP's hyper-parameters, weights and
optimizer state; the checkpoint directory lists the same files; and ``WeightAveraging`` (EMA), which stores its
averaged weights in the checkpoint, saves and resumes under zero1/zero2 as under DDP."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import CLASSES, VOCAB, make_trainer, token_dataset

RTOL, ATOL = 1e-5, 1e-6
STRATEGIES = ("ddp", 1, 2, 3)


class Net(pl.LightningModule):
    """Hyper-parameters, a tied weight, a 0-d parameter and BatchNorm buffers; validated every 2 steps."""

    def __init__(self, width: int = 8, lr: float = 0.05, label: str = "net") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(VOCAB, width)
        self.norm = nn.BatchNorm1d(width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, VOCAB, bias=False)
        self.out.weight = self.embed.weight
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.classes = nn.Linear(VOCAB, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.embed(tokens).mean(dim=1))
        return self.classes(self.out(torch.tanh(self.hidden(hidden))) / self.temperature)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens), targets)

    def validation_step(self, batch, batch_idx):
        tokens, targets = batch
        self.log("val_loss", nn.functional.cross_entropy(self(tokens), targets), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return DataLoader(token_dataset(), batch_size=4, shuffle=False)

    def val_dataloader(self):
        return DataLoader(token_dataset(64, seed=1), batch_size=4, shuffle=False)


def _strategy(name):
    return DDPStrategy() if name == "ddp" else ZeroStrategy(name)


def _fit(name, root: Path, steps: int = 6, callbacks=(), ckpt_path=None) -> tuple[pl.Trainer, ModelCheckpoint]:
    pl.seed_everything(4, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=root, monitor="val_loss", mode="min", save_top_k=1, save_last=True)
    trainer = make_trainer(_strategy(name), 2, max_steps=steps, callbacks=[checkpoints, *callbacks],
                           enable_checkpointing=True, val_check_interval=2, limit_val_batches=2,
                           num_sanity_val_steps=0)
    trainer.fit(Net(width=8, lr=0.05, label=f"trained under {name}"), ckpt_path=ckpt_path)
    return trainer, checkpoints


def _run(rank: int, world_size: int, root: Path) -> dict:
    out = {}
    for name in STRATEGIES:
        _, checkpoints = _fit(name, root / str(name))
        out[name] = {"best": checkpoints.best_model_path, "last": checkpoints.last_model_path,
                     "listing": sorted(os.listdir(root / str(name)))}
    # WeightAveraging: the checkpoint's state_dict holds the averaged weights, its own key the current ones; a
    # model loaded from it and a fit resumed from it (Lightning's test_ema_resume_ddp) behave as under DDP.
    for name in ("ddp", 1, 2):
        directory = root / f"ema-{name}"
        _, checkpoints = _fit(name, directory, steps=4, callbacks=[EMAWeightAveraging()])
        loaded = Net.load_from_checkpoint(checkpoints.best_model_path)
        trainer, _ = _fit(name, directory, steps=6, callbacks=[EMAWeightAveraging()],
                          ckpt_path=checkpoints.best_model_path)
        out["ema", name] = {
            "best": checkpoints.best_model_path,
            "loaded": {k: v.clone() for k, v in loaded.state_dict().items()},
            "resumed": {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()},
            "global_step": trainer.global_step,
        }
    return out


@lru_cache(maxsize=None)
def _results(root: str) -> list[dict]:
    return run_on_ranks(lambda r, w: _run(r, w, Path(root)), 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    per_rank = _results(str(tmp_path_factory.mktemp("checkpoint_files")))
    assert per_rank[0]["ddp"] == per_rank[1]["ddp"]  # every rank reports the same paths
    return per_rank[0]


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        if torch.is_tensor(value):
            assert got[key].shape == value.shape and got[key].dtype == value.dtype, key
            torch.testing.assert_close(got[key], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")
        else:
            assert got[key] == value, key


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_load_from_checkpoint_of_best_model_path_gives_ddps_model(runs, stage: int) -> None:
    want = Net.load_from_checkpoint(runs["ddp"]["best"])
    got = Net.load_from_checkpoint(runs[stage]["best"])
    assert Path(runs[stage]["best"]).is_file() and Path(runs[stage]["best"]).name == Path(runs["ddp"]["best"]).name
    assert dict(got.hparams) == dict(want.hparams, label="trained under " + str(stage))
    _assert_same_tensors(got.state_dict(), want.state_dict())
    assert got.out.weight is got.embed.weight  # the tie, as the constructor made it
    tokens = torch.arange(12).remainder(VOCAB).view(3, 4)
    got.eval(), want.eval()
    torch.testing.assert_close(got(tokens), want(tokens), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("which", ["best", "last"])
def test_torch_load_of_the_checkpoint_path_equals_ddps(runs, stage: int, which: str) -> None:
    want = torch.load(runs["ddp"][which])  # weights_only=True, torch's default
    got = torch.load(runs[stage][which])
    assert set(got) - {"lightning_zero"} == set(want) and got["lightning_zero"]["stage"] == stage
    for key in ("epoch", "global_step", "hparams_name", "pytorch-lightning_version", "loops", "lr_schedulers"):
        assert got[key] == want[key], key
    assert got["hyper_parameters"] == dict(want["hyper_parameters"], label=f"trained under {stage}")
    _assert_same_tensors(got["state_dict"], want["state_dict"])
    state = got["state_dict"]  # the tied weight is one storage under both names, as torch.save keeps it
    assert state["out.weight"].untyped_storage().data_ptr() == state["embed.weight"].untyped_storage().data_ptr()
    (got_opt,), (want_opt,) = got["optimizer_states"], want["optimizer_states"]
    assert got_opt["param_groups"] == want_opt["param_groups"]
    assert list(got_opt["state"]) == list(want_opt["state"])
    for position, entry in want_opt["state"].items():
        _assert_same_tensors(got_opt["state"][position], entry)
    mapped = torch.load(runs[stage][which], mmap=True)  # a model too large for memory maps it
    for key, value in got["state_dict"].items():
        assert torch.equal(mapped["state_dict"][key], value), key


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_checkpoint_directory_lists_what_ddps_lists(runs, stage: int) -> None:
    assert runs[stage]["listing"] == runs["ddp"]["listing"] and len(runs["ddp"]["listing"]) == 2  # best, last
    directory = Path(runs[stage]["best"]).parent
    assert all((directory / name).is_file() for name in runs[stage]["listing"])


def test_the_checkpoint_loads_where_lightning_zero_is_not_installed(runs) -> None:
    code = (
        "import sys; sys.modules['lightning_zero'] = None\n"  # any import of it fails
        "import torch\n"
        f"checkpoint = torch.load({runs[3]['best']!r})\n"
        "print(sum(float(v.double().sum()) for v in checkpoint['state_dict'].values()))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    state = torch.load(runs[3]["best"])["state_dict"]
    assert float(result.stdout) == pytest.approx(sum(float(v.double().sum()) for v in state.values()), rel=1e-12)


@pytest.mark.parametrize("stage", [1, 2])
def test_weight_averaging_saves_and_resumes_as_under_ddp(runs, stage: int) -> None:
    want, got = runs["ema", "ddp"], runs["ema", stage]
    _assert_same_tensors(got["loaded"], want["loaded"])  # the averaged weights, from best_model_path
    assert got["global_step"] == want["global_step"] == 6
    _assert_same_tensors(got["resumed"], want["resumed"])
    current = [torch.load(run["best"])["current_model_state"] for run in (got, want)]  # the weights before averaging
    _assert_same_tensors(*current)
