"""A user's own ``torch.optim.swa_utils.AveragedModel``, built in ``on_fit_start`` and updated after every batch (the
EMA written by hand), gives DDP's average under zero1, zero2 and zero3 (issue 52.3; see [Note: a user's copy of a
sharded module] in sharding/user_copies.py). Under zero3 it once failed at the first ``parameters_to_vector`` inside
``gathered_parameters()`` with ``cat() on the values of zero3 parameter ... outside a gathered scope``.

Three forms, each the same LightningModule on the same data under Lightning's DDP and under ZeroStrategy (2 ranks, one
fork for every case): ``AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(...))`` registered as ``self.ema``;
``AveragedModel(pl_module, avg_fn=get_ema_avg_fn(...))`` kept by a callback; ``AveragedModel(self.net,
use_buffers=True)`` (SWA's running mean, BatchNorm's statistics averaged too). Every 3 steps, inside
``gathered_parameters()`` (a no-op under DDP), the average as one vector and its output on fixed images; at
``on_train_end`` its ``state_dict()`` inside the scope, and outside it its forward (refused under zero3, naming the
scope) and the bytes its parameters hold (this rank's rows under zero3); after fit its ``state_dict()`` as it is.
"""

from __future__ import annotations

import contextlib
import copy
import io
from functools import lru_cache

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn
from torch.utils.data import DataLoader

from lightning_zero import ZeroStrategy
from lightning_zero.sharding.sharded_grad import held_rows
from lightning_zero.sharding.sharded_param import ShardedParameterError
from tests.distributed.semantics_models import image_data
from tests.harness import run_on_ranks
from tests.models import make_trainer

FP32 = dict(rtol=1e-5, atol=1e-6)
#: zero3 under bf16-mixed against DDP's bf16-mixed after 9 steps of AdamW (lr 1e-2): a gradient element near zero whose
#: sign bf16 rounding flips moves its weight by the lr the other way (as test_weight_callbacks.py measures).
BF16 = dict(rtol=0, atol=1e-2)
STRATEGIES = {
    "ddp": DDPStrategy,
    "zero1": lambda: ZeroStrategy(stage=1),
    "zero2": lambda: ZeroStrategy(stage=2),
    "zero3": lambda: ZeroStrategy(stage=3),
    "zero3_offload": lambda: ZeroStrategy(stage=3, offload_optimizer="cpu"),
}
FORMS = ("ema_multi_avg_fn", "ema_avg_fn_callback", "swa_use_buffers")
RUNS = [(name, "32-true") for name in STRATEGIES if name != "ddp"] + [("zero3", "bf16-mixed")]
STEPS = 9
PROBE = image_data(4, seed=11).tensors[0]


def _gathered(trainer: pl.Trainer):
    return getattr(trainer.strategy, "gathered_parameters", contextlib.nullcontext)()


class Net(pl.LightningModule):
    """A convolution, BatchNorm, a convolution and a 5-row head (3 rows on rank 0, 2 on rank 1) in ``self.net``;
    ``form`` says which AveragedModel it (or its callback) keeps."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(image_data(), batch_size=4)

    def on_fit_start(self) -> None:
        if self.form == "ema_multi_avg_fn":
            self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.8))
        elif self.form == "swa_use_buffers":
            self.ema = AveragedModel(self.net, use_buffers=True)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.form != "ema_avg_fn_callback":
            self.ema.update_parameters(self.net)


class OwnEMA(pl.Callback):
    """A user's EMA callback: ``AveragedModel(pl_module, avg_fn=...)`` made in ``on_fit_start``."""

    def on_fit_start(self, trainer, pl_module) -> None:
        self.average = AveragedModel(pl_module, avg_fn=get_ema_avg_fn(0.8))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.average.update_parameters(pl_module)


class Observe(pl.Callback):
    """The average every 3 steps and at the end of training, as user code reads it (placed after ``OwnEMA``)."""

    def __init__(self, average) -> None:
        self.average = average  # () -> the AveragedModel
        self.vectors: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self.end: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % 3:
            return
        average = self.average()
        with _gathered(trainer), torch.no_grad():
            self.vectors.append(torch.nn.utils.parameters_to_vector(average.parameters()).clone())
            self.outputs.append(average(PROBE).clone())

    def on_train_end(self, trainer, pl_module) -> None:
        average = self.average()
        with _gathered(trainer):
            self.end["state"] = {k: v.detach().clone() for k, v in average.module.state_dict().items()}
        self.end["bytes"] = sum(held_rows(p.detach()).numel() * p.element_size() for p in average.parameters())
        average.eval()  # BatchNorm's statistics stay as they are
        try:
            average(PROBE)
            self.end["outside"] = None
        except ShardedParameterError as err:
            self.end["outside"] = str(err)
        average.train()


def _fit(name: str, form: str, precision: str) -> dict:
    pl.seed_everything(7, verbose=False)
    module = Net(form)
    own = OwnEMA()
    average = (lambda: own.average) if form == "ema_avg_fn_callback" else (lambda: module.ema)
    observe = Observe(average)
    callbacks = [own, observe] if form == "ema_avg_fn_callback" else [observe]
    make_trainer(STRATEGIES[name](), 2, max_steps=STEPS, callbacks=callbacks, precision=precision).fit(module)
    after = average().module.state_dict()
    saved = io.BytesIO()
    torch.save(after, saved)  # whole after fit, as under DDP
    saved.seek(0)
    return {
        "vectors": observe.vectors,
        "outputs": observe.outputs,
        "end": observe.end,
        "after": {k: v.detach().float().clone() for k, v in after.items()},
        "saved": torch.load(saved, weights_only=True),
    }


def _one_rank_copies(rank: int) -> str:
    """A copy made on rank 0 only, then ``gathered_parameters()`` on every rank: the same error on both."""

    class OneRankCopy(Net):
        def on_fit_start(self) -> None:
            if rank == 0:
                self.snapshot = [copy.deepcopy(self.net)]

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            with self.trainer.strategy.gathered_parameters():
                pass

    try:
        make_trainer(ZeroStrategy(stage=3), 2, max_steps=2).fit(OneRankCopy("none"))
    except ShardedParameterError as err:
        return str(err)
    return "no error"


def _run(rank: int, world_size: int) -> dict:
    out = {}
    for form in FORMS:
        for name, precision in [("ddp", "32-true"), ("ddp", "bf16-mixed"), *RUNS]:
            out[form, name, precision] = _fit(name, form, precision)
    out["one_rank"] = _one_rank_copies(rank)
    return out


@lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_on_ranks(_run, 2)


@pytest.fixture(scope="module")
def per_rank():
    return results()


def _close(got, want, tolerance: dict, what: str) -> None:
    torch.testing.assert_close(got.float(), want.float(), **tolerance, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name,precision", RUNS)
def test_averaged_model_gives_ddps_average(per_rank, form: str, name: str, precision: str) -> None:
    tolerance = FP32 if precision == "32-true" else BF16
    for rank in per_rank:
        got, want = rank[form, name, precision], rank[form, "ddp", precision]
        assert len(got["vectors"]) == len(want["vectors"]) == STEPS // 3
        for step, (g, w) in enumerate(zip(got["vectors"], want["vectors"])):
            _close(g, w, tolerance, f"average after step {3 * (step + 1)}")
        for step, (g, w) in enumerate(zip(got["outputs"], want["outputs"])):
            _close(g, w, tolerance, f"the average's output after step {3 * (step + 1)}")
        assert got["end"]["state"].keys() == want["end"]["state"].keys()
        for key, value in want["end"]["state"].items():
            _close(got["end"]["state"][key], value, tolerance, f"state_dict at on_train_end {key}")
            _close(got["after"][key], value, tolerance, f"state_dict after fit {key}")
            _close(got["saved"][key], value, tolerance, f"torch.save after fit {key}")


def _rows_bytes(rank: int) -> int:
    """The bytes of rank ``rank``'s rows of Net's fp32 parameters on 2 ranks: every first dimension is 8 (4 rows
    each) but the head's 5 (3 rows on rank 0, 2 on rank 1)."""
    total = 0
    for p in Net("none").net.parameters():
        rows = p.shape[0]
        mine = min(-(-rows // 2), rows) if rank == 0 else rows - min(-(-rows // 2), rows)
        total += mine * (p.numel() // rows)
    return 4 * total


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["zero3", "zero3_offload"])
def test_under_zero3_the_average_holds_this_ranks_rows(per_rank, form: str, name: str) -> None:
    """Outside a gathered scope each rank's copy holds its rows only (4Ψ/N bytes for an fp32 copy), and a forward of
    it is refused naming the scope that makes it whole."""
    psi = sum(p.numel() for p in Net("none").net.parameters())
    assert _rows_bytes(0) + _rows_bytes(1) == 4 * psi and _rows_bytes(0) != _rows_bytes(1)
    for r, rank in enumerate(per_rank):
        want = rank[form, "ddp", "32-true"]["end"]
        assert want["outside"] is None and want["bytes"] == 4 * psi
        got = rank[form, name, "32-true"]["end"]
        assert got["bytes"] == _rows_bytes(r), form
        assert "copy of zero3 parameter" in got["outside"] and "gathered_parameters()" in got["outside"]


def test_a_copy_made_on_one_rank_is_refused_on_every_rank(per_rank) -> None:
    params = list(Net("none").net.parameters())
    psi, count = sum(p.numel() for p in params), len(params)
    for rank in per_rank:
        assert (f"rank 0: {count} copies of {psi} elements, rank 1: 0 copies of 0 elements" in rank["one_rank"]
                and "must be made on every rank" in rank["one_rank"]), rank["one_rank"]
