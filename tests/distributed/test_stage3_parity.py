"""Stage 3 against DDP, every step: tied embeddings (built on the meta device), frozen + LoRA parameters, a module
called twice, a parameter unused on some steps; then validate / test / predict after fit."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import AdapterModel, ParityModel, Recorder, TinyLM, flat_params, make_trainer

STEPS = 10
RTOL, ATOL = 1e-5, 1e-6


@dataclass(frozen=True)
class Case:
    name: str
    units: tuple[str, ...]
    reshard_after_forward: bool = True

    def model(self) -> pl.LightningModule:
        if self.name == "tied_lm":
            return TinyLM()
        if self.name == "adapter":
            return AdapterModel()
        return ParityModel("adamw", with_unused=True)


CASES = [
    Case("tied_lm", ("Block",)),
    Case("tied_lm", ("Linear", "LayerNorm"), reshard_after_forward=False),
    Case("adapter", ("LoRALinear", "mix", "embed")),
    Case("unused", ("Linear",)),
]


def _fit(strategy, case: Case, world_size: int) -> tuple[Recorder, pl.LightningModule, pl.Trainer]:
    pl.seed_everything(1234, verbose=False)
    model, recorder = case.model(), Recorder()
    trainer = make_trainer(strategy, world_size, max_steps=STEPS, callbacks=[recorder])
    trainer.fit(model)
    return recorder, model, trainer


def _run_all(rank: int, world_size: int) -> dict:
    out = {}
    for case in CASES:
        unused = case.name == "unused"
        ddp, _, _ = _fit(DDPStrategy(find_unused_parameters=unused), case, world_size)
        zero = ZeroStrategy(
            3, units=case.units, reshard_after_forward=case.reshard_after_forward, find_unused_parameters=unused
        )
        z3, model, trainer = _fit(zero, case, world_size)
        out[case] = {"ddp": (ddp.losses, ddp.params), "zero3": (z3.losses, z3.params)}
    # Evaluation after fit, on the trained model, against the same weights under DDP.
    case = CASES[0]
    recorder, model, trainer = _fit(ZeroStrategy(3, units=case.units), case, world_size)
    evaluation = {
        "after_fit": (flat_params(model), recorder.params[-1], [p.device.type for p in model.parameters()]),
        "validate": trainer.validate(model, verbose=False)[0]["val_loss"],
        "test": trainer.test(model, verbose=False)[0]["val_loss"],
        "predict": torch.cat(trainer.predict(model)),
    }
    reference = make_trainer(DDPStrategy(), world_size)
    evaluation["ddp_validate"] = reference.validate(model, verbose=False)[0]["val_loss"]
    evaluation["ddp_predict"] = torch.cat(reference.predict(model))
    evaluation["unit_count"] = len(trainer.strategy.runtime.parameters.units)
    out["evaluation"] = evaluation
    return out


@lru_cache(maxsize=None)
def results(world_size: int) -> list[dict]:
    return run_on_ranks(_run_all, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.name}-{'-'.join(c.units)}-raf{int(c.reshard_after_forward)}")
def test_zero3_matches_ddp_every_step(world_size: int, case: Case) -> None:
    for rank, per_rank in enumerate(results(world_size)):
        ddp_losses, ddp_params = per_rank[case]["ddp"]
        losses, params = per_rank[case]["zero3"]
        assert len(params) == len(ddp_params) == STEPS
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=RTOL, atol=ATOL)
        for step, (got, want) in enumerate(zip(params, ddp_params)):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {rank} step {step}: {m}")
        assert not torch.allclose(params[0], params[-1])


@pytest.mark.parametrize("world_size", [2])
def test_evaluation_after_fit_matches_ddp(world_size: int) -> None:
    for per_rank in results(world_size):
        evaluation = per_rank["evaluation"]
        assert evaluation["validate"] == pytest.approx(evaluation["ddp_validate"], rel=1e-6)
        assert evaluation["test"] == pytest.approx(evaluation["ddp_validate"], rel=1e-6)
        assert torch.equal(evaluation["predict"], evaluation["ddp_predict"])


def test_module_holds_full_trained_weights_after_fit() -> None:
    for per_rank in results(2):
        after_fit, last_step, devices = per_rank["evaluation"]["after_fit"]
        assert torch.equal(after_fit, last_step)
        assert set(devices) == {"cpu"}
