"""An inf or NaN in one rank's gradients, in fp32 and bf16 (fp16's loss scaler has its own tests): every rank sees it
and takes the same decision under ``nonfinite_grads``, so the ranks never diverge. ``check_replicas`` is the check
that they did not, and is itself checked on ranks made to differ."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_zero import NonFiniteGradientsError, ZeroStrategy
from lightning_zero.replicas import ReplicaMismatchError
from tests.harness import run_on_ranks
from tests.models import ParityModel, Recorder, make_trainer

BAD_STEP = 2
STEPS = 4
CASES = [(stage, precision) for stage in (1, 2, 3) for precision in ("32-true", "bf16-mixed")]


class NonFiniteOnRank1(ParityModel):
    """Rank 1's gradients at optimizer step ``BAD_STEP`` get ``value`` in one sample's logits gradient, which
    reaches every parameter's gradient through backward."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self(tokens)
        if self.global_rank == 1 and self.global_step == BAD_STEP:
            logits.register_hook(lambda g: g.index_fill(0, torch.tensor([0], device=g.device), self.value))
        return nn.functional.cross_entropy(logits, targets)


def _strategy(stage: int, **options) -> ZeroStrategy:
    units = {"units": ("Linear", "Embedding")} if stage == 3 else {}
    return ZeroStrategy(stage, **units, **options)


def _skip_run(stage: int, precision: str, value: float, **options) -> dict:
    recorder = Recorder()
    trainer = make_trainer(_strategy(stage, nonfinite_grads="skip", **options), 2, max_steps=STEPS,
                           callbacks=[recorder], precision=precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(NonFiniteOnRank1(value))
    return {
        "params": recorder.params,
        "skipped": trainer.strategy.runtime.skipped_steps,
        "warnings": [str(w.message) for w in caught if "non-finite" in str(w.message)],
        "replicas": trainer.strategy.check_replicas(),
    }


def _raise_run(stage: int, precision: str) -> str:
    trainer = make_trainer(_strategy(stage, nonfinite_grads="raise"), 2, max_steps=STEPS, precision=precision)
    try:
        trainer.fit(NonFiniteOnRank1(float("nan")))
    except NonFiniteGradientsError as err:
        return f"{trainer.global_step}: {err}"
    return "no error"


def _mismatch(rank: int) -> str:
    trainer = make_trainer(_strategy(2), 2, max_steps=1)
    model = ParityModel()
    trainer.fit(model)
    assert trainer.strategy.check_replicas() > 0  # identical after a normal step
    if rank == 1:
        with torch.no_grad():
            model.head.bias[0] += 1.0
    try:
        trainer.strategy.check_replicas()
    except ReplicaMismatchError as err:
        return str(err)
    return "no error"


def _all_cases(rank: int, world_size: int) -> dict:
    out = {"skip": {}, "raise": {}}
    for i, (stage, precision) in enumerate(CASES):
        value = float("inf") if i % 2 else float("nan")
        out["skip"][stage, precision] = _skip_run(stage, precision, value)
    out["skip"]["offload"] = _skip_run(2, "32-true", float("inf"), offload_optimizer="cpu")
    out["mismatch"] = _mismatch(rank)
    for stage, precision in CASES[::3]:
        out["raise"][stage, precision] = _raise_run(stage, precision)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_on_ranks(_all_cases, 2)


@pytest.mark.parametrize("case", [*CASES, "offload"], ids=str)
def test_skip_skips_the_step_on_every_rank_and_the_ranks_stay_identical(results, case) -> None:
    rank0, rank1 = results[0]["skip"][case], results[1]["skip"][case]
    assert rank0["skipped"] == rank1["skipped"] == 1
    assert len(rank0["params"]) == STEPS
    for step, (p0, p1) in enumerate(zip(rank0["params"], rank1["params"])):
        assert torch.isfinite(p0).all(), f"step {step}: a non-finite value reached the parameters"
        assert torch.equal(p0, p1), f"step {step}: the ranks diverged"
    for step in range(1, STEPS):
        changed = not torch.equal(rank0["params"][step], rank0["params"][step - 1])
        assert changed == (step != BAD_STEP), f"step {step}: {'stepped' if changed else 'skipped'}"
    assert len(rank0["warnings"]) == 1 and "skipped on every rank" in rank0["warnings"][0]
    assert rank0["replicas"] == rank1["replicas"] > 0


@pytest.mark.parametrize("case", CASES[::3], ids=str)
def test_raise_raises_on_every_rank_at_the_bad_step(results, case) -> None:
    for rank in (0, 1):
        message = results[rank]["raise"][case]
        assert message.startswith(f"{BAD_STEP}: non-finite gradients (inf or NaN)"), message
        assert "rank" in message and "nonfinite_grads='skip'" in message


def test_check_replicas_names_the_tensor_that_differs(results) -> None:
    for rank in (0, 1):
        message = results[rank]["mismatch"]
        assert message.startswith("1 replicated tensor(s) differ between ranks: head.bias (rank(s) [1] differ"), message
