"""Lightning's own weight-averaging callbacks under zero3 give DDP's results (issue 39; see [Note: Lightning's weight
callbacks under zero3] in sharded_callbacks.py): ``EMAWeightAveraging`` swapped in for validation inside fit and
copied in at the end of it, saved and resumed; ``StochasticWeightAveraging`` with its BatchNorm update epoch, saved
and resumed; each average kept as this rank's rows (4Ψ/N bytes per rank for an fp32 average). Each case runs the
same LightningModule (a convolution, BatchNorm, a 5-row head split unevenly over 2 ranks, a 0-d scale) on the same
data under Lightning's DDP and under zero3 (fp32, bf16-mixed, zero3_offload), 2 ranks, one fork for every case.
``ModelPruning`` under zero3 is in test_user_code.py, with the other callbacks that write parameters.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

from lightning_zero import ZeroStrategy
from lightning_zero.sharding.sharded_grad import ShardedRows
from tests.distributed.semantics_models import ConvNet, image_data
from tests.harness import run_on_ranks
from tests.models import make_trainer

FP32 = dict(rtol=1e-5, atol=1e-6)
EXACT = dict(rtol=0, atol=0)
#: Losses under bf16-mixed against DDP's bf16-mixed (DDP keeps fp32 parameters under autocast; ours are bf16 with
#: fp32 masters): measured within 7e-4.
BF16_LOSSES = dict(rtol=2e-3, atol=1e-5)
#: Weights after 7-12 steps under bf16-mixed: a gradient element near zero whose sign bf16 rounding flips moves its
#: weight by AdamW's lr (1e-2) the other way; measured within 4.3e-3.
BF16_WEIGHTS = dict(rtol=0, atol=1e-2)
STRATEGIES = {
    "ddp": DDPStrategy,
    "zero3": lambda: ZeroStrategy(stage=3),
    "zero3_offload": lambda: ZeroStrategy(stage=3, offload_optimizer="cpu"),
}
RUNS = [("zero3", "32-true"), ("zero3_offload", "32-true"), ("zero3", "bf16-mixed"), ("zero3_offload", "bf16-mixed")]


class Net(ConvNet):
    """ConvNet (a convolution, BatchNorm, a convolution) with a 5-row head (3 rows on rank 0, 2 on rank 1) and a 0-d
    scale, validated on 16 images."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 5)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def val_dataloader(self):
        return DataLoader(image_data(16, seed=5), batch_size=4)


class Record(pl.Callback):
    """Every training loss, every validation loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val.append(float(trainer.callback_metrics["val_loss"]))


class SaveAt(pl.Callback):
    """A checkpoint in the middle of fit: after training step ``step``, or at the end of epoch ``epoch``."""

    def __init__(self, path: Path, step: int | None = None, epoch: int | None = None) -> None:
        self.path, self.step, self.epoch = path, step, epoch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


def _ema() -> EMAWeightAveraging:
    return EMAWeightAveraging(decay=0.7)


def _swa() -> StochasticWeightAveraging:
    return StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=2)


def _rows(tensor: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """A tensor as this rank holds it: a ShardedRows' rows, or a full tensor's every row."""
    if isinstance(tensor, ShardedRows):
        return tensor._layout.lo, tensor._layout.hi, tensor._local.detach().float().clone()
    return 0, max(tensor.numel(), 1), tensor.detach().float().clone().reshape(tensor.shape or (1,))


def _fit(name: str, callback, precision: str = "32-true", ckpt_path=None, save=None, **kwargs):
    pl.seed_everything(7, verbose=False)
    record = Record()
    callbacks = [callback, record] + ([save] if save is not None else [])
    trainer = make_trainer(STRATEGIES[name](), 2, callbacks=callbacks, precision=precision, **kwargs)
    trainer.fit(Net(), ckpt_path=ckpt_path)
    return trainer, record


def _average(callback) -> nn.Module:
    average = callback._average_model
    return average.module if isinstance(callback, EMAWeightAveraging) else average


def _outcome(trainer, record, callback, root: Path, tag: str) -> dict:
    """Losses, the module after fit, the average (as this rank holds it) and the bytes its parameters hold, and a
    checkpoint saved after fit as torch.load reads it."""
    average = _average(callback)
    path = root / f"{tag}.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False, map_location="cpu")
    return {
        "losses": record.losses,
        "val": record.val,
        "module": {k: v.detach().float().clone() for k, v in trainer.lightning_module.state_dict().items()},
        "average": {k: _rows(p) for k, p in average.named_parameters()},
        "average_bytes": sum(_rows(p)[2].numel() * p.element_size() for p in average.parameters()),
        "sharded": all(isinstance(p, ShardedRows) for p in average.parameters()),
        "saved": {k: v.float() for k, v in saved["state_dict"].items()},
        "saved_swa": {k: v.float() for k, v in saved["callbacks"].get(_swa().state_key, {})
                      .get("average_model_state", {}).items()},
    }


def _ema_cases(root: Path) -> dict:
    out = {}
    for name, precision in [("ddp", "32-true"), ("ddp", "bf16-mixed"), *RUNS]:
        callback = _ema()
        trainer, record = _fit(name, callback, precision, max_steps=7, val_check_interval=3, limit_val_batches=2)
        out["ema", name, precision] = _outcome(trainer, record, callback, root, f"ema-{name}-{precision}")
    for name in ("ddp", "zero3", "zero3_offload"):  # saved after step 4 of 8; resumed from there
        _fit(name, _ema(), max_steps=8, limit_val_batches=0, save=SaveAt(root / f"ema-half-{name}.ckpt", step=4))
        callback = _ema()
        trainer, record = _fit(name, callback, max_steps=8, limit_val_batches=0,
                               ckpt_path=root / f"ema-half-{name}.ckpt")
        out["ema_resumed", name] = _outcome(trainer, record, callback, root, f"ema-resumed-{name}")
    return out


def _swa_cases(root: Path) -> dict:
    out = {}
    epochs = dict(max_steps=-1, limit_train_batches=4, limit_val_batches=2)
    for name, precision in [("ddp", "32-true"), ("ddp", "bf16-mixed"), *RUNS]:
        callback = _swa()  # 2 epochs of training, the second one averaged, and the BatchNorm epoch
        trainer, record = _fit(name, callback, precision, max_epochs=2, **epochs)
        out["swa", name, precision] = _outcome(trainer, record, callback, root, f"swa-{name}-{precision}")
    for name in ("ddp", "zero3"):  # saved after epoch 2 of 4 (1 and 2 averaged); resumed for epoch 3 and BatchNorm's
        _fit(name, _swa(), max_epochs=4, max_steps=-1, limit_train_batches=4, limit_val_batches=0,
             save=SaveAt(root / f"swa-half-{name}.ckpt", epoch=2))
        callback = _swa()
        trainer, record = _fit(name, callback, max_epochs=4, max_steps=-1, limit_train_batches=4, limit_val_batches=0,
                               ckpt_path=root / f"swa-half-{name}.ckpt")
        out["swa_resumed", name] = _outcome(trainer, record, callback, root, f"swa-resumed-{name}")
    return out


def _run(rank: int, world_size: int, root: Path) -> dict:
    return {**_ema_cases(root), **_swa_cases(root)}


@lru_cache(maxsize=None)
def results(root: str) -> list[dict]:
    return run_on_ranks(lambda r, w: _run(r, w, Path(root)), 2)


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return results(str(tmp_path_factory.mktemp("weight_callbacks")))


def _close(got, want, tolerance: dict, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), **tolerance, msg=lambda m: f"{what}: {m}")


def _same_weights(got: dict, want: dict, tolerance: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        _close(got[key], want[key], tolerance, f"{what} {key}")


def _same_average(got: dict, want: dict, tolerance: dict, what: str) -> None:
    """This rank's rows of the average's parameters against the same rows of ``want``'s (DDP's whole average)."""
    assert got.keys() <= want.keys() and len(got) == 8  # every parameter of Net
    for key, (lo, hi, rows) in got.items():
        _close(rows, want[key][2][lo:hi], tolerance, f"{what} {key}")


@pytest.mark.parametrize("kind", ["ema", "swa"])
@pytest.mark.parametrize("name,precision", RUNS)
def test_average_is_swapped_in_and_copied_in_as_under_ddp(per_rank, kind: str, name: str, precision: str) -> None:
    losses, weights = (FP32, FP32) if precision == "32-true" else (BF16_LOSSES, BF16_WEIGHTS)
    for rank in per_rank:
        got, want = rank[kind, name, precision], rank[kind, "ddp", precision]
        # EMA: 7 steps, validated after steps 3 and 6 (the average swapped in); SWA: 2 epochs of 4 steps, then the
        # BatchNorm epoch (4 forwards), each validated
        assert len(got["losses"]) == len(want["losses"]) == {"ema": 7, "swa": 12}[kind]
        assert len(got["val"]) == len(want["val"]) == {"ema": 2, "swa": 3}[kind]
        _close(got["losses"], want["losses"], losses, "training losses")  # the model is swapped back each time
        _close(got["val"], want["val"], losses, "validation losses")  # on the average
        _same_average(got["average"], want["average"], weights, "average")
        _same_weights(got["module"], want["module"], weights, "module after fit")
        _same_average(got["average"], {k: _rows(v) for k, v in got["module"].items()}, EXACT, "module is the average")
        # the file holds rank 0's module (buffers are rank 0's: BatchNorm's statistics differ by rank, as under DDP)
        _same_weights(got["saved"], per_rank[0][kind, name, precision]["module"], EXACT, "checkpoint saved after fit")


def test_the_average_holds_this_ranks_rows_only(per_rank) -> None:
    """4Ψ/N bytes per rank for an fp32 average (N = 2), counted from what the average's parameters hold: Ψ is
    Net's parameter count; its 5-row head and 0-d scale split 3/2 and 1/0, so the ranks differ by their rows."""
    model = Net()
    psi = sum(p.numel() for p in model.parameters())
    rows = {0: 0, 1: 0}
    for p in model.parameters():
        chunk = -(-(p.shape[0] if p.dim() else 1) // 2)
        per_row = p[0].numel() if p.dim() else 1
        total = p.shape[0] if p.dim() else 1
        rows[0] += min(chunk, total) * per_row
        rows[1] += (total - min(chunk, total)) * per_row
    for r, rank in enumerate(per_rank):
        for kind in ("ema", "swa"):
            assert rank[kind, "ddp", "32-true"]["average_bytes"] == 4 * psi  # the whole model under DDP
            for name in ("zero3", "zero3_offload"):
                got = rank[kind, name, "32-true"]
                assert got["sharded"] and got["average_bytes"] == 4 * rows[r], (kind, name)
                assert abs(got["average_bytes"] - 4 * psi / 2) <= 4 * 40  # the head's and scale's odd rows
    assert rows[0] + rows[1] == psi


@pytest.mark.parametrize("kind,name", [("ema", "zero3"), ("ema", "zero3_offload"), ("swa", "zero3")])
def test_average_is_saved_and_resumed_as_under_ddp(per_rank, kind: str, name: str) -> None:
    for rank in per_rank:
        got, want = rank[f"{kind}_resumed", name], rank[f"{kind}_resumed", "ddp"]
        assert len(got["losses"]) == len(want["losses"]) == {"ema": 4, "swa": 8}[kind]
        _close(got["losses"], want["losses"], FP32, "losses after resuming")
        _same_weights(got["module"], want["module"], FP32, "module after fit")
        _same_average(got["average"], want["average"], FP32, "average")
        if kind == "swa":  # the callback's own state: the whole average, in the file
            _same_weights(got["saved_swa"], want["saved_swa"], FP32, "SWA's saved average")
