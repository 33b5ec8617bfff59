"""Plain zero1, zero2 and zero3 pay nothing for the options they do not use (issue 41): a step (2 ranks, gloo, the
default options) calls no hybrid-sharding, ZeRO++ (quantized gathers and reductions, hpZ, node-by-node collectives)
or weight-check code, reads no tensor on the host (zero3's check that ranks run the same units, ``verify_unit_order``,
reads the ranks' shared-memory board: unit_order.py), and issues the same collectives every step: one reduce-scatter and one all-gather
per bucket (zero3: per unit) and nothing else. Calls are counted by wrapping the functions in each rank; one fork runs
the three stages."""

from __future__ import annotations

import collections
import functools
import inspect
import sys
from functools import lru_cache

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.sharding import by_node, collectives, in_flight, quantized_collectives
from tests.harness import run_on_ranks
from tests.models import ParityModel, make_trainer

#: What only hybrid sharding, ZeRO++ and the node-by-node collectives call.
OPTION_CODE = {
    "Collectives.two_stage", "Collectives._reduce_scatter_quantized", "Collectives._reduce_across_nodes",
    "Collectives._all_gather_quantized", "by_node.gather_rows", "by_node.reduce_scatter",
    "quantized_collectives.quantize", "quantized_collectives.TwoStageReduce", "in_flight.dequantize",
    "WeightCheck.record",
}
#: Collectives a plain step has no use for (no clipping, no norm, an element-wise optimizer, no barrier).
UNUSED_COLLECTIVES = {"Collectives.all_reduce_", "Collectives.record_all_reduce", "Collectives.all_to_all",
                      "Collectives.all_gather_object", "Collectives.barrier", "Collectives.broadcast_"}
STEPS = 5


def _count(counts: collections.Counter, owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        counts[label] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def _count_host_reads(counts: collections.Counter) -> None:
    """``item``/``tolist``/``bool`` of a tensor called from lightning_zero's code, by module."""
    for name in ("item", "tolist", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            module = sys._getframe(1).f_globals.get("__name__", "")
            if module.startswith("lightning_zero"):
                counts[f"host read in {module}"] += 1
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)


def _run(rank: int, world_size: int) -> dict:
    counts: collections.Counter = collections.Counter()
    for name in dir(collectives.Collectives):  # its own methods and those it inherits (the quantized collectives)
        if not name.startswith("__") and inspect.isfunction(inspect.getattr_static(collectives.Collectives, name)):
            _count(counts, collectives.Collectives, name, f"Collectives.{name}")
    for owner, names in ((by_node, ("gather_rows", "reduce_scatter")),
                         (quantized_collectives, ("quantize", "TwoStageReduce")),
                         (in_flight, ("dequantize",)), (in_flight.WeightCheck, ("record",))):
        for name in names:
            _count(counts, owner, name, f"{getattr(owner, '__name__', '').rpartition('.')[2]}.{name}")
    _count_host_reads(counts)

    class PerStep(pl.Callback):
        """What each step called, from one batch's start to the next's (or the end of training): a callback with no
        hook that sees the step's gradients, so that the step is plain (with one, the gradient norms a rank may read
        alone are kept: two small all-reduces a step, see [Note: a read that runs on one rank])."""

        def __init__(self) -> None:
            self.steps: list[dict] = []
            self._started = False

        def on_train_batch_start(self, *args) -> None:
            if self._started:
                self.steps.append(dict(counts))
            counts.clear()
            self._started = True

        def on_train_end(self, *args) -> None:
            self.steps.append(dict(counts))

    out = {}
    for stage in (1, 2, 3):
        pl.seed_everything(7, verbose=False)
        per_step = PerStep()
        trainer = make_trainer(ZeroStrategy(stage=stage), world_size, max_steps=STEPS, callbacks=[per_step])
        trainer.fit(ParityModel())
        runtime = trainer.strategy.runtime
        units = len(runtime.parameters.all_units) if stage == 3 else None
        out[stage] = per_step.steps, units
    return out


@lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_on_ranks(_run, 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_plain_step_runs_no_code_of_the_options_it_does_not_use(stage: int) -> None:
    for rank in results():
        steps, _ = rank[stage]
        assert len(steps) == STEPS
        for step in steps[1:]:  # after the first step (lazy set-up)
            assert not OPTION_CODE & step.keys(), sorted(OPTION_CODE & step.keys())
            assert not UNUSED_COLLECTIVES & step.keys(), sorted(UNUSED_COLLECTIVES & step.keys())
            reads = {k: v for k, v in step.items() if k.startswith("host read")}
            assert reads == {}  # zero3's unit-order check included: its ranks share a host (a board in memory)
            assert "Collectives.exchange_async" not in step


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_plain_step_issues_the_same_collectives_every_step(stage: int) -> None:
    for rank in results():
        steps, units = rank[stage]
        # from the third step on (zero3 checks the first two steps' unit order in lockstep, see [Note: ranks that run
        # different units])
        assert all(step == steps[2] for step in steps[3:])
        # ParityModel: one bucket at the default bucket_mb; zero3: one unit (the root: gathered once a step)
        assert steps[2]["Collectives.reduce_scatter"] == 1
        assert steps[2]["Collectives.all_gather"] == 1
        if stage == 3:
            assert units == 1
