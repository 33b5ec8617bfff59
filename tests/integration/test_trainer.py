"""The real Trainer paths: Lightning's own fork launcher, world size 1, checkpoints saved and resumed."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

import lightning_zero.strategy  # also registers the strategy names
from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import ParityModel, Recorder, flat_params, make_trainer


def _fit_in_this_process(strategy: str, devices: int) -> torch.Tensor:
    pl.seed_everything(7, verbose=False)
    model = ParityModel("adamw")
    make_trainer(strategy, devices, max_steps=6).fit(model)
    return flat_params(model)


@pytest.mark.parametrize("stage", [1, 2])
def test_fork_launcher_trains_like_ddp(stage: int) -> None:
    """``Trainer(strategy="zeroN_fork", devices=2)`` launched by Lightning itself; rank 0's weights come back."""
    reference = _fit_in_this_process("ddp_fork", 2)
    got = _fit_in_this_process(f"zero{stage}_fork", 2)
    assert not torch.equal(got, flat_params(ParityModel("adamw")))
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6)


def _single(rank: int, world_size: int) -> dict:
    out = {}
    for name, strategy in [("single", "auto"), ("zero1", "zero1"), ("zero2", "zero2")]:
        pl.seed_everything(3, verbose=False)
        model, recorder = ParityModel("sgd"), Recorder()
        trainer = make_trainer(strategy, 1, max_steps=5, callbacks=[recorder], use_distributed_sampler=False)
        trainer.fit(model)
        out[name] = (recorder.losses, recorder.params)
    return out


def test_world_size_one_equals_plain_training() -> None:
    (result,) = run_on_ranks(_single, 1)
    # Equal up to the last bit or two: the optimizer's vectorized kernels round differently on differently aligned
    # gradient storage (stage 2 keeps gradients in a flat shard buffer).
    for name in ("zero1", "zero2"):
        torch.testing.assert_close(torch.tensor(result[name][0]), torch.tensor(result["single"][0]), rtol=1e-6, atol=0)
        for got, want in zip(result[name][1], result["single"][1]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def _events_of_a_fit(rank: int, world_size: int) -> list[str]:
    events: list[str] = []
    lightning_zero.strategy.settle_mkl_dispatch = lambda: events.append("settle")  # this forked rank only

    class Events(pl.Callback):
        def setup(self, *_args, **_kwargs) -> None:
            events.append("setup")

        def on_before_optimizer_step(self, *_args) -> None:
            events.append("step")

    pl.seed_everything(0, verbose=False)
    make_trainer(ZeroStrategy(stage=2), 1, max_steps=2, callbacks=[Events()]).fit(ParityModel("adamw"))
    return events


def test_the_strategy_settles_mkl_before_setup_and_the_first_step() -> None:
    """host_math.py's warm-up runs in ``setup_environment``: before the callbacks' ``setup`` and the first step."""
    (events,) = run_on_ranks(_events_of_a_fit, 1)
    assert events == ["settle", "setup", "step", "step"]


def _save_in_the_launching_process(strategy: str, path) -> dict[str, torch.Tensor]:
    pl.seed_everything(7, verbose=False)
    model = ParityModel("adamw")
    trainer = make_trainer(strategy, 2, max_steps=6)
    trainer.fit(model)
    trainer.save_checkpoint(path)  # this process launched the ranks and never trained: it holds rank 0's weights
    saved = torch.load(path, weights_only=True)["state_dict"]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    trainer._checkpoint_connector.restore(path)  # and loads as DDP does (Lightning's run_model_test)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    return saved


@pytest.mark.parametrize("stage", [1, 3])
def test_the_launching_process_saves_the_weights_like_ddp(stage: int, tmp_path) -> None:
    """After a fork (or spawn) launch, ``trainer.save_checkpoint`` in the launching process writes one regular file
    of the weights rank 0 sent back, and restoring it there loads them, as under DDP (Lightning's
    ``test_multi_cpu_model_ddp`` does both)."""
    reference = _save_in_the_launching_process("ddp_fork", tmp_path / "ddp.ckpt")
    got = _save_in_the_launching_process(f"zero{stage}_fork", tmp_path / "zero.ckpt")
    assert got.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(got[key], reference[key], rtol=1e-5, atol=1e-6)
    assert not torch.equal(got["head.weight"], ParityModel("adamw").head.weight)  # trained, not the initial weights
