"""World size 1 with the short cut (the default): the shortest path, the same checkpoints.

No hook is installed on the module or its parameters, the parameters stay whole at every stage (stage 3 included,
meta-device init included), and a checkpoint saved on one rank resumes exactly and loads at two ranks under stage 3.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import Recorder, StepSeededLM, make_trainer

STEPS = 6


def _fit(world_size: int, stage: int, steps: int = STEPS, ckpt_path=None, precision: str = "32-true"):
    pl.seed_everything(5, verbose=False)
    model = StepSeededLM()
    recorder = Recorder()
    trainer = make_trainer(ZeroStrategy(stage=stage), world_size, max_steps=steps, callbacks=[recorder],
                           precision=precision, use_distributed_sampler=False)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model, recorder


def _hooks(model: torch.nn.Module) -> int:
    modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    params = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
    return modules + params


class Probe(pl.Callback):
    """During fit: how many hooks the module and its parameters carry, and whether every parameter is whole."""

    def on_train_batch_end(self, trainer, pl_module, *_args) -> None:
        self.hooks = _hooks(pl_module)
        self.whole = all(p.numel() > 0 for p in pl_module.parameters())


def _one_rank(rank: int, world_size: int, root: Path) -> dict:
    out = {}
    for stage in (1, 2, 3):
        for precision in ("32-true", "bf16-mixed"):
            probe = Probe()
            pl.seed_everything(5, verbose=False)
            trainer = make_trainer(ZeroStrategy(stage=stage), 1, max_steps=2, callbacks=[probe],
                                   precision=precision, use_distributed_sampler=False)
            trainer.fit(StepSeededLM())
            out[stage, precision] = (probe.hooks, probe.whole, trainer.strategy.comm_stats.total_calls)
    first, _, _ = _fit(1, 3, steps=3)
    first.save_checkpoint(root / "one.ckpt")
    _, _, resumed = _fit(1, 3, ckpt_path=root / "one.ckpt")
    _, _, uninterrupted = _fit(1, 3)
    out["resume"] = (resumed.params, uninterrupted.params)
    out["saved"] = first.lightning_module.state_dict()
    return out


def _two_ranks(rank: int, world_size: int, root: Path) -> dict:
    loaded = make_trainer(ZeroStrategy(stage=3), world_size, max_steps=3, use_distributed_sampler=False)
    model = StepSeededLM()
    loaded.validate(model, ckpt_path=root / "one.ckpt", verbose=False)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@cache
def results(root: str) -> tuple[dict, list[dict]]:
    one = run_on_ranks(lambda r, w: _one_rank(r, w, Path(root)), 1)[0]
    two = run_on_ranks(lambda r, w: _two_ranks(r, w, Path(root)), 2)
    return one, two


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    return results(str(tmp_path_factory.mktemp("single_rank_path")))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_no_hooks_no_collectives_whole_parameters(outcome, stage: int, precision: str) -> None:
    hooks, whole, calls = outcome[0][stage, precision]
    assert hooks == 0 and whole and calls == 0


def test_stage3_checkpoint_on_one_rank_resumes_exactly(outcome) -> None:
    resumed, uninterrupted = outcome[0]["resume"]
    assert len(resumed) == STEPS - 3
    for got, want in zip(resumed, uninterrupted[3:]):
        assert torch.equal(got, want)


def test_one_rank_checkpoint_loads_at_two_ranks(outcome) -> None:
    saved = outcome[0]["saved"]
    for per_rank in outcome[1]:
        assert set(per_rank) <= set(saved)
        for name, value in per_rank.items():
            torch.testing.assert_close(value, saved[name].to(value.dtype), rtol=0, atol=0)
