"""The fp16 loss scaler user code reaches (``trainer.precision_plugin.scaler``) is the ``torch.amp.GradScaler`` the
``MixedPrecision`` plugin was given, itself, and holds DDP's values after the same steps: its whole public API and
``state_dict`` at every step, with an overflow on one rank backing the scale off on both, under zero1, zero2 and
zero3 (2 ranks); and its state crosses checkpoints between DDP and ZeRO in both directions."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import ParityModel, make_trainer

STRATEGIES = ("ddp", 1, 2, 3)
STEPS = 9


def _strategy(name, plugin: MixedPrecision):
    if name == "ddp":
        return DDPStrategy(precision_plugin=plugin)
    return ZeroStrategy(name, units=("Linear", "Embedding"), precision_plugin=plugin) if name == 3 else ZeroStrategy(
        name, precision_plugin=plugin
    )


def _plugin() -> MixedPrecision:
    # Lightning turns precision="16-mixed" into bf16 on CPU; the fp16 plugin a CUDA run gets is passed explicitly.
    # A short growth interval and a large backoff make growth and backoff both happen within a few steps.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2, backoff_factor=0.25)
    return MixedPrecision("16-mixed", "cpu", scaler=scaler)


class OverflowOnRank1(ParityModel):
    """Rank 1's loss is inf at steps 3 and 4: every rank must skip those steps and back off twice."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-4, weight_decay=0.0)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx in (3, 4) and self.global_rank == 1 else loss


class ScalerAPI(pl.Callback):
    """What user code reads from the scaler after every step: every getter and the state_dict."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(_api(trainer.precision_plugin.scaler))


def _api(scaler: torch.amp.GradScaler) -> tuple:
    return (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval(),
            scaler.is_enabled(), scaler.state_dict())


def _fit(name, steps=STEPS, ckpt_path=None, callbacks=()):
    pl.seed_everything(3, verbose=False)
    plugin = _plugin()
    api = ScalerAPI()
    trainer = make_trainer(_strategy(name, plugin), 2, max_steps=steps, callbacks=[api, *callbacks])
    trainer.fit(OverflowOnRank1(), ckpt_path=ckpt_path)
    return trainer, plugin, api


def _run(rank: int, world_size: int, root: Path) -> dict:
    out = {}
    for name in STRATEGIES:
        trainer, plugin, api = _fit(name)
        scaler = trainer.precision_plugin.scaler
        out[name] = {
            "itself": scaler is plugin.scaler and type(scaler) is torch.amp.GradScaler,
            "mixed": isinstance(trainer.precision_plugin, MixedPrecision),
            "seen": api.seen,
        }
    # Checkpoints: a ZeRO checkpoint resumed under DDP and a DDP one under ZeRO restore the scaler exactly.
    for saver, loader in (("ddp", 2), (2, "ddp"), (3, 1)):
        path = root / f"{saver}-{loader}.ckpt"
        trainer, _, _ = _fit(saver, steps=5)
        trainer.save_checkpoint(path)
        saved = _api(trainer.precision_plugin.scaler)
        _, _, api = _fit(loader, steps=6, ckpt_path=path)
        out["resumed", saver, loader] = (saved, api.seen)
    return out


@lru_cache(maxsize=None)
def _results(root: str) -> list[dict]:
    return run_on_ranks(lambda r, w: _run(r, w, Path(root)), 2)


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return _results(str(tmp_path_factory.mktemp("scaler")))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_scaler_is_the_plugins_grad_scaler_with_ddps_values_at_every_step(per_rank, stage: int) -> None:
    for rank in per_rank:
        ddp, zero = rank["ddp"], rank[stage]
        assert ddp["itself"] and zero["itself"]  # the very GradScaler the MixedPrecision plugin was given
        assert ddp["mixed"] and zero["mixed"]  # trainer.precision_plugin is a MixedPrecision, as under DDP
        assert len(zero["seen"]) == len(ddp["seen"]) == STEPS
        assert zero["seen"] == ddp["seen"]
    # What the steps did to it: growth every 2 clean steps, backoff by 0.25 at each of the two overflows.
    scales = [seen[0] for seen in per_rank[0]["ddp"]["seen"]]
    assert scales == [2.0**12, 2.0**13, 2.0**13, 2.0**11, 2.0**9, 2.0**9, 2.0**10, 2.0**10, 2.0**11]
    assert per_rank[0]["ddp"]["seen"][-1][5] == {
        "scale": 2.0**11, "growth_factor": 2.0, "backoff_factor": 0.25, "growth_interval": 2, "_growth_tracker": 0
    }


@pytest.mark.parametrize("saver,loader", [("ddp", 2), (2, "ddp"), (3, 1)])
def test_the_scaler_state_crosses_checkpoints_between_ddp_and_zero(per_rank, saver, loader) -> None:
    for rank in per_rank:
        saved, seen = rank["resumed", saver, loader]
        assert saved[5] == {
            "scale": 2.0**9, "growth_factor": 2.0, "backoff_factor": 0.25, "growth_interval": 2, "_growth_tracker": 0
        }  # saved right after the second overflow
        # One more clean step after the resume counts towards growth from the restored state.
        assert seen == [(2.0**9, 2.0, 0.25, 2, True, dict(saved[5], _growth_tracker=1))]
