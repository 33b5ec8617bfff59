"""A user's own precision plugin (a ``MixedPrecision`` subclass, as Lightning's ``test_amp_ddp[True-MyAMP-*]``)
under zero1, zero2 and zero3 as under DDP (2 ranks): it stays ``trainer.precision_plugin``, the very object the user
passed, its overrides run as often as under DDP, the fp16 steps give DDP's losses and loss scale, and its state is
saved under its own class name, crossing checkpoints between DDP and ZeRO in both directions."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import ParityModel, Recorder, make_trainer

STAGES = (1, 2, 3)
STEPS = 6
#: fp16 losses within this relative distance of DDP's (DDP keeps fp32 parameters under autocast, ZeRO fp16 working
#: copies of fp32 masters: tests/distributed/test_precision_clip_accumulate.py measures the same bound).
MIXED_RTOL = 3e-3


class CountingAMP(MixedPrecision):
    """A user's plugin with overrides DDP honours: it counts the forward contexts it opens and the losses it scales,
    and keeps the counts in its state beside the scaler's."""

    def __init__(self) -> None:
        # Lightning turns precision="16-mixed" into bf16 on CPU; the fp16 plugin of a CUDA run is built explicitly.
        super().__init__("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2))
        self.forwards = 0
        self.backwards = 0

    def forward_context(self):
        self.forwards += 1
        return super().forward_context()

    def pre_backward(self, tensor, module):
        self.backwards += 1
        return super().pre_backward(tensor, module)

    def state_dict(self):
        return {"scaler": super().state_dict(), "counts": [self.forwards, self.backwards]}

    def load_state_dict(self, state):
        super().load_state_dict(state["scaler"])
        self.forwards, self.backwards = state["counts"]


class SmallLR(ParityModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-4, weight_decay=0.0)


def _strategy(name):
    if name == "ddp":
        return "ddp"
    return ZeroStrategy(name, units=("Linear", "Embedding")) if name == 3 else ZeroStrategy(name)


def _fit(name, steps: int, ckpt_path=None):
    torch.manual_seed(5)
    plugin = CountingAMP()
    recorder = Recorder()
    trainer = make_trainer(_strategy(name), 2, max_steps=steps, callbacks=[recorder], plugins=[plugin])
    trainer.fit(SmallLR(), ckpt_path=ckpt_path)
    return trainer, plugin, recorder


def _run(rank: int, world_size: int, root: Path) -> dict:
    out = {}
    for name in ("ddp", *STAGES):
        trainer, plugin, recorder = _fit(name, STEPS)
        path = root / f"{name}.ckpt"
        trainer.save_checkpoint(path)
        saved = torch.load(path, weights_only=False)
        out[name] = {
            "itself": trainer.precision_plugin is plugin,
            "user_class": isinstance(trainer.precision_plugin, CountingAMP) and type(plugin).__name__ == "CountingAMP",
            "counts": (plugin.forwards, plugin.backwards),
            "scale": plugin.scaler.get_scale(),
            "losses": recorder.losses,
            "saved": saved.get("CountingAMP"),
            "precision_keys": sorted(k for k in saved if "Precision" in k or k == "CountingAMP"),
        }
    for saver, loader in (("ddp", 2), (3, "ddp")):
        _, plugin, _ = _fit(loader, STEPS + 1, ckpt_path=root / f"{saver}.ckpt")
        out["resumed", saver, loader] = ((plugin.forwards, plugin.backwards), plugin.scaler.state_dict())
    return out


@lru_cache(maxsize=None)
def _results(root: str) -> list[dict]:
    return run_on_ranks(lambda r, w: _run(r, w, Path(root)), 2)


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return _results(str(tmp_path_factory.mktemp("plugins")))


@pytest.mark.parametrize("stage", STAGES)
def test_a_users_mixed_precision_subclass_runs_as_under_ddp(per_rank, stage: int) -> None:
    for rank in per_rank:
        ddp, zero = rank["ddp"], rank[stage]
        assert ddp["itself"] and zero["itself"]  # the object the user passed is the Trainer's plugin
        assert ddp["user_class"] and zero["user_class"]
        assert zero["counts"] == ddp["counts"] == (STEPS, STEPS)  # its overrides ran at every step
        assert zero["scale"] == ddp["scale"] == 2.0**15  # grown at steps 2, 4 and 6: no step overflowed
        losses = np.array(zero["losses"])
        assert len(losses) == STEPS
        assert np.max(np.abs(losses - ddp["losses"]) / np.abs(ddp["losses"])) < MIXED_RTOL
        # Its state is saved under its own class name, as DDP saves it.
        assert zero["precision_keys"] == ddp["precision_keys"] == ["CountingAMP"]
        assert zero["saved"] == ddp["saved"] == {
            "scaler": {"scale": 2.0**15, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2,
                       "_growth_tracker": 0},
            "counts": [STEPS, STEPS],
        }


@pytest.mark.parametrize("saver,loader", [("ddp", 2), (3, "ddp")])
def test_a_users_plugin_state_crosses_checkpoints_between_ddp_and_zero(per_rank, saver, loader) -> None:
    for rank in per_rank:
        counts, scaler = rank["resumed", saver, loader]
        assert counts == (STEPS + 1, STEPS + 1)  # restored from the checkpoint, then one more step
        assert scaler == {"scale": 2.0**15, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2,
                          "_growth_tracker": 1}
