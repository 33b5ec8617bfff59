"""What user code sees of a parameter and its gradient, on one CUDA device with the collectives really issued over
NCCL (``shortcut_single_rank=False``): hooks that read and edit sharded gradients (their norms and reductions are
NCCL all-reduces of CUDA tensors), ``gathered_gradients``, Lightning's EMA callback writing ``.data`` at the end of
fit, and optimizers that own whole parameters (their rows and updates travel by NCCL all-to-all), each against
DDP on the same device (world size 1: the same data order) and data. The CPU suite checks the same at 2 ranks against DDP
(tests/distributed/test_user_code.py, test_optimizers.py); this one runs the CUDA paths. Skipped without a GPU."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from lightning_zero.sharding.sharded_grad import ShardedRows
from tests.distributed.test_user_code import EveryStep, GradHooks
from tests.models import ParityModel
from tests.optimizers import MuonWithAuxAdam

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FP32 = dict(rtol=1e-4, atol=1e-5)


def _fit(strategy, model_fn, precision: str = "32-true", callbacks=(), steps: int = 6):
    pl.seed_everything(7, verbose=False)
    every = EveryStep()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cuda", devices=1, max_steps=steps, precision=precision,
        callbacks=[*callbacks, every], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(model_fn())
    return trainer, every.params


def _zero(stage: int, **kwargs) -> ZeroStrategy:
    return ZeroStrategy(stage=stage, shortcut_single_rank=False, **kwargs)


def _close(got: list, want: list, tolerance: dict) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, **tolerance, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("hook", ["clip_norm", "zero_rows_mask", "reads", "gathered"])
def test_gradient_hooks_on_nccl_give_ddp(stage: int, hook: str) -> None:
    trainer, params = _fit(_zero(stage), lambda: GradHooks(hook))
    reference, want = _fit(DDPStrategy(), lambda: GradHooks(hook))
    _close(params, want, FP32)
    seen, seen_want = trainer.lightning_module.seen, reference.lightning_module.seen
    if hook == "gathered":
        _close([t.float().cpu() for t in seen], [t.float().cpu() for t in seen_want], FP32)
    else:
        torch.testing.assert_close(torch.tensor(seen, dtype=torch.float64),
                                   torch.tensor(seen_want, dtype=torch.float64), **FP32)


@pytest.mark.parametrize("stage,precision", [(1, "32-true"), (2, "bf16-mixed"), (3, "32-true"), (3, "bf16-mixed")])
def test_ema_average_is_the_model_after_fit_on_the_gpu(stage: int, precision: str) -> None:
    # EMAWeightAveraging copies the average into the module through .data at on_train_end.
    trainer, _ = _fit(_zero(stage), ParityModel, precision, callbacks=[EMAWeightAveraging(decay=0.7)])
    with trainer.strategy.gathered_parameters():
        got = {k: v.detach().float().cpu().clone() for k, v in trainer.lightning_module.state_dict().items()}
    if precision == "32-true":
        reference, _ = _fit(DDPStrategy(), ParityModel, precision, callbacks=[EMAWeightAveraging(decay=0.7)])
        want, tolerance = {k: v.detach().float().cpu() for k, v in reference.lightning_module.state_dict().items()}, FP32
    else:  # DDP's bf16-mixed keeps fp32 parameters: compare with our own average, one bf16 rounding apart
        ema = next(c for c in trainer.callbacks if isinstance(c, EMAWeightAveraging))
        want = {k: _whole(v).detach().float().cpu() for k, v in ema._average_model.module.state_dict().items()}
        tolerance = dict(rtol=2**-7, atol=1e-6)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], **tolerance, msg=lambda m: f"{key}: {m}")


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A zero3 average's rows (a ``ShardedRows``): at world size 1, every row."""
    return tensor._local.reshape(tensor.shape) if isinstance(tensor, ShardedRows) else tensor


class MuonModel(ParityModel):
    """ParityModel whose matrices a user's Muon-with-auxiliary-AdamW steps (a non-element-wise update: each is
    stepped whole by the rank that owns it)."""

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.dim() == 2]
        rest = [p for p in self.parameters() if p.dim() != 2]
        return MuonWithAuxAdam([{"params": matrices, "use_muon": True}, {"params": rest}])


@pytest.mark.parametrize("stage", [1, 3])
def test_a_whole_parameter_optimizer_on_nccl_gives_ddp(stage: int) -> None:
    _, params = _fit(_zero(stage), MuonModel)
    _, want = _fit(DDPStrategy(), MuonModel)
    _close(params, want, FP32)
