"""Under zero3 a parameter keeps its full shape between uses, as under DDP (issue 29, point 2): parameter counts in
``on_train_start`` and ``training_step``, Lightning's ``ModelSummary`` (the utility, the callback every fit runs and a
user's subclass of it), ``p.shape`` and ``state_dict()``'s keys and shapes equal DDP's on every rank, for the same
LightningModule (a 0-d parameter, an 11-row embedding padded at 2 ranks, a transformer block); reading a value
outside a gathered scope is one clear error, and inside ``gathered_parameters()`` the values equal DDP's.
"""

from __future__ import annotations

from functools import lru_cache

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as summarize_model

from lightning_zero import ZeroStrategy
from lightning_zero.sharding.sharded_param import ShardedParameterError
from tests.harness import run_on_ranks
from tests.models import ParityModel, make_trainer


class _CountingModel(ParityModel):
    def on_train_start(self) -> None:
        self.seen = {"on_train_start": sum(p.numel() for p in self.parameters())}
        summary = summarize_model(self, max_depth=2)
        self.seen["ModelSummary()"] = (summary.total_parameters, summary.trainable_parameters, summary.param_nums)
        self.seen["shapes"] = [tuple(p.shape) for p in self.parameters()]
        self.seen["state_dict"] = {k: tuple(v.shape) for k, v in self.state_dict().items()}
        # what Lightning's launcher checks (test_memory_sharing_disabled): metadata, answered as under DDP
        self.seen["shared, pinned"] = [(p.is_shared(), p.is_pinned()) for p in self.parameters()]

    def training_step(self, batch, batch_idx):
        self.seen.setdefault("training_step", sum(p.numel() for p in self.parameters()))
        return super().training_step(batch, batch_idx)


class _RecordingSummary(ModelSummary):
    """A user's ModelSummary subclass: what Lightning hands its ``summarize``."""

    def summarize(self, summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  **kwargs) -> None:
        params = dict(summary_data)["Params"]
        self.recorded = (total_parameters, trainable_parameters, params)


class _Reads(pl.Callback):
    """Reading a parameter's values between steps: outside a gathered scope, then inside one."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        weight = pl_module.head.weight
        try:
            self.outside = float(weight.sum())
        except ShardedParameterError as error:
            self.outside = str(error)
        gathered = getattr(trainer.strategy, "gathered_parameters", None)
        with gathered() if gathered is not None else torch.no_grad():
            self.inside = [p.detach().clone() for p in pl_module.parameters()]


def _fit(rank: int, world_size: int, strategy) -> dict:
    torch.manual_seed(0)
    model = _CountingModel()
    summary, reads = _RecordingSummary(max_depth=1), _Reads()
    trainer = make_trainer(strategy, world_size, max_steps=2, callbacks=[summary, reads], enable_model_summary=True)
    trainer.fit(model)
    return {**model.seen, "callback": getattr(summary, "recorded", None), "outside": reads.outside,
            "inside": reads.inside}


@lru_cache(maxsize=1)
def _results() -> dict:
    def run(rank: int, world_size: int) -> dict:
        return {name: _fit(rank, world_size, strategy) for name, strategy in [
            ("ddp", "ddp"), ("zero3", ZeroStrategy(stage=3)), ("zero2", ZeroStrategy(stage=2))]}

    return run_on_ranks(run, 2)


@pytest.mark.parametrize("stage", ["zero3", "zero2"])
def test_counts_shapes_and_summaries_are_the_models_as_under_ddp(stage: str) -> None:
    for rank in _results():
        ddp, ours = rank["ddp"], rank[stage]
        total = sum(p.numel() for p in ParityModel().parameters())
        assert ddp["on_train_start"] == ddp["training_step"] == total
        for key in ("on_train_start", "training_step", "ModelSummary()", "shapes", "state_dict", "shared, pinned"):
            assert ours[key] == ddp[key], key
        if ddp["callback"] is not None or ours["callback"] is not None:  # the callback summarizes on rank 0
            assert ours["callback"] == ddp["callback"]
            assert ours["callback"][0] == total


def test_values_are_read_inside_a_gathered_scope_only() -> None:
    for rank in _results():
        ddp, zero3, zero2 = rank["ddp"], rank["zero3"], rank["zero2"]
        assert isinstance(ddp["outside"], float) and zero2["outside"] == pytest.approx(ddp["outside"], rel=1e-5)
        assert zero3["outside"].startswith("sum() on a zero3 parameter outside a gathered scope")
        assert "trainer.strategy.gathered_parameters()" in zero3["outside"]
        for ours in (zero3, zero2):
            for a, b in zip(ours["inside"], ddp["inside"]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
