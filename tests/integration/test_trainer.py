"""The real Trainer paths: Lightning's own fork launcher, world size 1, checkpoints saved and resumed."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

import lightning_zero  # noqa: F401  (registers the strategy names)
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


def _save_and_resume(rank: int, world_size: int, root: Path) -> dict:
    out = {}
    for name, strategy in [("ddp", DDPStrategy), ("zero1", "zero1"), ("zero2", "zero2")]:
        pl.seed_everything(11, verbose=False)
        model = ParityModel("groups_sched")
        trainer = make_trainer(strategy() if callable(strategy) else strategy, world_size, max_steps=3)
        trainer.fit(model)
        trainer.save_checkpoint(root / f"{name}.ckpt")
    # Resume each checkpoint under another strategy: DDP's under zero2, zero1's under DDP, zero2's under zero1.
    for name, source, strategy in [
        ("ddp_resumed", "ddp", DDPStrategy),
        ("zero2_from_ddp", "ddp", lambda: "zero2"),
        ("ddp_from_zero1", "zero1", DDPStrategy),
        ("zero1_from_zero2", "zero2", lambda: "zero1"),
    ]:
        pl.seed_everything(11, verbose=False)
        model, recorder = ParityModel("groups_sched"), Recorder()
        trainer = make_trainer(strategy(), world_size, max_steps=8, callbacks=[recorder])
        trainer.fit(model, ckpt_path=root / f"{source}.ckpt")
        out[name] = (recorder.losses, recorder.params)
    return out


def test_checkpoints_hold_full_states_and_resume_under_any_strategy(tmp_path: Path) -> None:
    per_rank = run_on_ranks(functools.partial(_save_and_resume, root=tmp_path), 2)
    ddp = torch.load(tmp_path / "ddp.ckpt", weights_only=False)
    for name in ("zero1", "zero2"):
        ckpt = torch.load(tmp_path / f"{name}.ckpt", weights_only=False)
        for key, value in ddp["state_dict"].items():
            torch.testing.assert_close(ckpt["state_dict"][key], value, rtol=1e-5, atol=1e-6)
        want, got = ddp["optimizer_states"][0], ckpt["optimizer_states"][0]
        assert got["param_groups"] == want["param_groups"]
        assert got["state"].keys() == want["state"].keys()
        for index, state in want["state"].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert got["state"][index][key].shape == state[key].shape
                torch.testing.assert_close(got["state"][index][key], state[key], rtol=1e-5, atol=1e-7)
        assert ckpt["lr_schedulers"] == ddp["lr_schedulers"]
    for result in per_rank:
        want_losses, want_params = result["ddp_resumed"]
        assert len(want_params) == 5
        for name in ("zero2_from_ddp", "ddp_from_zero1", "zero1_from_zero2"):
            losses, params = result[name]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
            for got, want in zip(params, want_params):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
