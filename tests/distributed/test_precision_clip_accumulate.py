"""Mixed precision with fp32 master shards, fp16 loss scaling, global-norm clipping, gradient accumulation and two
optimizers, each against Lightning's DDP with the same settings."""

from __future__ import annotations

from functools import lru_cache

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import ParityModel, Recorder, TinyGAN, flat_params, make_trainer

STAGES = (1, 2, 3)
# Mixed precision: losses within 3e-3 relative of DDP with the same flag over 20 steps. DDP computes with fp32
# parameters under autocast, ZeRO with bf16 working parameters, so they differ by bf16 rounding; a run that updates
# 16-bit weights directly (DDP's "bf16-true", checked below as a control) misses the bound by more than 3x.
MIXED_RTOL = 3e-3


def zero(stage: int, units: tuple[str, ...] = ("Linear", "Embedding"), **kwargs) -> ZeroStrategy:
    """ZeroStrategy at ``stage``; stage 3 with ``units`` (every entry must name a module of the model)."""
    return ZeroStrategy(stage, **({"units": units} if stage == 3 else {}), **kwargs)


def fp16_plugin() -> MixedPrecision:
    # Lightning maps precision="16-mixed" to bf16 on CPU; the fp16 plugin a CUDA run would get is passed explicitly.
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


class SmallLR(ParityModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-4, weight_decay=0.0)


class Norms(pl.Callback):
    """DDP: the total norm of the (full, reduced) gradients before clipping; ZeRO: the strategy's own figure."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if not isinstance(trainer.strategy, ZeroStrategy):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.last_grad_norm is not None:
            self.norms.append(float(trainer.strategy.last_grad_norm))


class InfOnRank1(SmallLR):
    """Rank 1's loss is inf on batch 3: every rank must skip that step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 3 and self.global_rank == 1:
            loss = loss * float("inf")
        return loss


class Scale(pl.Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.scales.append(trainer.strategy.precision_plugin.scaler.get_scale())


class MixedBytes(pl.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 2:
            self.held = trainer.strategy.model_state_bytes()


def _fit(strategy, model, world_size, steps, **kwargs):
    recorder = Recorder()
    callbacks = kwargs.pop("callbacks", []) + [recorder]  # the recorder last: its gathers are not counted
    make_trainer(strategy, world_size, max_steps=steps, callbacks=callbacks, **kwargs).fit(model)
    return recorder


def _seeded(cls, *args):
    pl.seed_everything(21, verbose=False)
    return cls(*args)


def _run(rank: int, world_size: int) -> dict:
    out: dict = {}
    # Mixed precision: bf16 (and the bf16-true control), fp16 with loss scaling.
    out["bf16_ddp"] = _fit(DDPStrategy(), _seeded(SmallLR), world_size, 20, precision="bf16-mixed").losses
    out["bf16_true_ddp"] = _fit(DDPStrategy(), _seeded(SmallLR), world_size, 20, precision="bf16-true").losses
    for stage in STAGES:
        out[("bf16", stage)] = _fit(zero(stage), _seeded(SmallLR), world_size, 20, precision="bf16-mixed").losses
    out["fp16_ddp"] = _fit(DDPStrategy(precision_plugin=fp16_plugin()), _seeded(SmallLR), world_size, 20).losses
    for stage in (2, 3):
        strategy = zero(stage, precision_plugin=fp16_plugin())
        out[("fp16", stage)] = _fit(strategy, _seeded(SmallLR), world_size, 20).losses
    # Model-state bytes in bf16-mixed.
    for stage in STAGES:
        probe = MixedBytes()
        _fit(zero(stage), _seeded(SmallLR, "adamw", 64), world_size, 3, precision="bf16-mixed", callbacks=[probe])
        out[("bytes", stage)] = (probe.held.total, sum(p.numel() for p in SmallLR("adamw", 64).parameters()))
    # fp16 overflow on one rank.
    scale = Scale()
    recorder = _fit(zero(2, precision_plugin=fp16_plugin()), _seeded(InfOnRank1), world_size, 6, callbacks=[scale])
    out["inf"] = (recorder.params, scale.scales)
    # Clipping by norm and by value.
    for algorithm, value in (("norm", 0.05), ("value", 0.01)):
        clip = {"gradient_clip_val": value, "gradient_clip_algorithm": algorithm}
        norms = Norms()
        ddp = _fit(DDPStrategy(), _seeded(ParityModel), world_size, 8, callbacks=[norms], **clip)
        out[("clip", algorithm, "ddp")] = (ddp.params, norms.norms)
        for stage in STAGES:
            norms = Norms()
            got = _fit(zero(stage), _seeded(ParityModel), world_size, 8, callbacks=[norms], **clip)
            out[("clip", algorithm, stage)] = (got.params, norms.norms)
    # Gradient accumulation, with the communication of every micro-batch.
    for accumulate in (2, 4):
        out[("acc", accumulate, "ddp")] = _fit(DDPStrategy(), _seeded(ParityModel), world_size, 5, accumulate_grad_batches=accumulate).params
        for stage in STAGES:
            comm = CommPerBatch()
            rec = _fit(zero(stage), _seeded(ParityModel), world_size, 5, accumulate_grad_batches=accumulate, callbacks=[comm])
            out[("acc", accumulate, stage)] = (rec.params, comm.calls)
    # Two optimizers, manual optimization.
    out[("gan", "ddp")] = _fit_gan(DDPStrategy(find_unused_parameters=True), world_size)
    for stage in STAGES:
        out[("gan", stage)] = _fit_gan(zero(stage, ("Linear",), find_unused_parameters=True), world_size)
    return out


class CommPerBatch(pl.Callback):
    def __init__(self) -> None:
        self.calls: list[dict[str, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        trainer.strategy.comm_stats.reset()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.calls.append({op: s.calls for op, s in trainer.strategy.comm_stats.by_op.items()})


def _fit_gan(strategy, world_size: int):
    model = _seeded(TinyGAN)
    params = []

    class AfterBatch(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            gathered = getattr(trainer.strategy, "gathered_parameters", None)
            with gathered() if gathered else torch.no_grad():
                params.append(flat_params(pl_module))

    make_trainer(strategy, world_size, max_steps=16, callbacks=[AfterBatch()]).fit(model)
    return model.losses, params


@lru_cache(maxsize=None)
def results(world_size: int) -> list[dict]:
    return run_on_ranks(_run, world_size)


def _max_rel(got, want) -> float:
    got, want = np.array(got), np.array(want)
    return float(np.max(np.abs(got - want) / np.abs(want)))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", STAGES)
def test_bf16_mixed_tracks_ddp(world_size: int, stage: int) -> None:
    for per_rank in results(world_size):
        assert len(per_rank[("bf16", stage)]) == 20
        assert _max_rel(per_rank[("bf16", stage)], per_rank["bf16_ddp"]) < MIXED_RTOL


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_mixed_tolerance_catches_16_bit_weight_updates(world_size: int) -> None:
    for per_rank in results(world_size):
        assert _max_rel(per_rank["bf16_true_ddp"], per_rank["bf16_ddp"]) > 2 * MIXED_RTOL


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_mixed_tracks_ddp(world_size: int, stage: int) -> None:
    for per_rank in results(world_size):
        assert _max_rel(per_rank[("fp16", stage)], per_rank["fp16_ddp"]) < MIXED_RTOL


# Bytes of model states a rank holds in bf16-mixed (AdamW), in units of Ψ: the ZeRO paper's 2Ψ + 2Ψ + 12Ψ, sharded
# by stage, except that stage 3 keeps no 16-bit copy of its shard (cast from the fp32 master when gathered): 14Ψ/N,
# where the paper's formula says 16Ψ/N.
MIXED_FORMULAS = {1: lambda n: 4 + 12 / n, 2: lambda n: 2 + 14 / n, 3: lambda n: 14 / n}
PAPER_STAGE3 = lambda n: 16 / n  # noqa: E731
# The ranks' totals sum to N times the formula within 0.03% at 2 and 4 ranks (measured: 120 and 240 bytes over
# 596,000, AdamW's step counters); one rank alone is off by up to 1.2% (0.16Ψ/N at 4 ranks: uneven rows), which
# is why the sum is compared. 1% then separates stage 3's 14Ψ/N from the paper's 16Ψ/N by 14 times the tolerance
# (the bound was 10% of 16Ψ/N per rank: 1.6Ψ/N against a difference of 2Ψ/N, so 15.5Ψ/N passed).
BYTES_RTOL = 0.01


def test_the_bytes_tolerance_separates_every_formula_from_the_others() -> None:
    for n in (2, 4):
        assert PAPER_STAGE3(n) - MIXED_FORMULAS[3](n) > 10 * BYTES_RTOL * PAPER_STAGE3(n)
        formulas = [MIXED_FORMULAS[1](n), MIXED_FORMULAS[2](n), MIXED_FORMULAS[3](n), PAPER_STAGE3(n)]
        for i, a in enumerate(formulas):  # stages 1 and 2 are closest at 2 ranks: 10Ψ/N against 9Ψ/N
            for b in formulas[i + 1:]:
                assert abs(a - b) >= 5 * BYTES_RTOL * max(a, b), (n, a, b)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", STAGES)
def test_bf16_mixed_bytes_match_the_zero_paper(world_size: int, stage: int) -> None:
    ranks = results(world_size)
    psi = ranks[0][("bytes", stage)][1]
    held = sum(per_rank[("bytes", stage)][0] for per_rank in ranks)
    expected = world_size * MIXED_FORMULAS[stage](world_size) * psi
    assert abs(held - expected) <= BYTES_RTOL * expected, (held / psi, expected / psi)


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(world_size: int) -> None:
    for per_rank in results(world_size):
        params, scales = per_rank["inf"]
        assert torch.equal(params[3], params[2])  # batch 3: no update on any rank
        assert not torch.equal(params[4], params[3])  # and training goes on
        assert scales[2] == 2.0**16 and scales[3] == 2.0**15 and scales[5] == 2.0**15
    assert all(torch.equal(r["inf"][0][-1], results(world_size)[0]["inf"][0][-1]) for r in results(world_size))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_matches_ddp(world_size: int, stage: int, algorithm: str) -> None:
    for per_rank in results(world_size):
        want_params, want_norms = per_rank[("clip", algorithm, "ddp")]
        got_params, got_norms = per_rank[("clip", algorithm, stage)]
        if algorithm == "norm":
            np.testing.assert_allclose(got_norms, want_norms, rtol=1e-5)
            assert max(want_norms) > 0.05  # clipping was active
        for got, want in zip(got_params, want_params):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# Collectives per micro-batch while accumulating (non-boundary) and at the boundary, for ParityModel.
EXPECTED_CALLS = {
    1: ({}, {"reduce_scatter": 1, "all_gather": 1}),
    2: ({"reduce_scatter": 1}, {"reduce_scatter": 1, "all_gather": 1}),
    # Stage 3 gathers its 6 units for forward and for backward but the last (kept gathered between them) and the
    # root once, and reduces each of the 6 units and the root once its backward is done, on every micro-batch; the
    # first micro-batch gathers the last unit again too (no micro-batch before it says which unit runs last).
    3: ({"all_gather": 12, "reduce_scatter": 7}, {"all_gather": 12, "reduce_scatter": 7}),
}
FIRST_STAGE3_CALLS = {"all_gather": 13, "reduce_scatter": 7}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("accumulate", [2, 4])
def test_accumulation_matches_ddp_with_the_documented_communication(world_size, stage, accumulate) -> None:
    for per_rank in results(world_size):
        want = per_rank[("acc", accumulate, "ddp")]
        got, calls = per_rank[("acc", accumulate, stage)]
        assert len(got) == len(want) == 5
        # Stages 2 and 3 average every micro-batch and sum the averages, DDP sums and then averages once; at 4 ranks
        # gloo also sums in another order. Adam magnifies those last-bit differences to a few 1e-6 after 5 steps.
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        accumulating, boundary = EXPECTED_CALLS[stage]
        expected = ([accumulating] * (accumulate - 1) + [boundary]) * 5
        if stage == 3:
            expected[0] = FIRST_STAGE3_CALLS
        assert calls == expected


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", STAGES)
def test_two_optimizers_manual_optimization_matches_ddp(world_size: int, stage: int) -> None:
    for per_rank in results(world_size):
        want_losses, want_params = per_rank[("gan", "ddp")]
        got_losses, got_params = per_rank[("gan", stage)]
        assert len(got_losses) == 16  # max_steps=16 counts both optimizers' steps: 8 batches, 2 losses each
        np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, atol=1e-6)
        for a, b in zip(got_params, want_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
