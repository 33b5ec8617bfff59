"""Valid configurations, drawn by hypothesis over every option that changes how a step runs, train: a 2-step fit on
2 ranks finishes with finite losses and ranks that agree on the parameters. The configurations that must be refused,
and how, are tests/unit/test_config_properties.py; this is its other half, that what is accepted runs.

Hypothesis draws the whole list at once and every fit runs in one spawn (one fork of 2 ranks, ~0.3 s a fit); a
failure is reported with its list, not shrunk (each try would be a spawn).
"""

from __future__ import annotations

import math
import warnings
from functools import partial

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import Recorder, TinyLM, make_trainer

STEPS = 2
FIT_SETTINGS = dict(max_examples=1, deadline=None, database=None, phases=[Phase.explicit, Phase.generate])


@st.composite
def fit_configurations(draw) -> tuple[dict, str]:
    """ZeRO options valid together (by the rules of lightning_zero.config), and a precision flag."""
    stage = draw(st.sampled_from([1, 2, 3]))
    options = {
        "stage": stage,
        "bucket_mb": draw(st.sampled_from([1e-6, 0.001, 0.01, 25.0])),
        "inplace_mb": draw(st.sampled_from([None, 1e-6, 0.01, 1.0])),
        "reduce_dtype": draw(st.sampled_from([None, "fp32", "bf16", "fp16"])),
        "nonfinite_grads": draw(st.sampled_from(["ignore", "skip", "raise"])),
        "find_unused_parameters": draw(st.booleans()),
        "broadcast_buffers": draw(st.booleans()),
        "shortcut_single_rank": draw(st.booleans()),
        "activation_checkpointing_policy": draw(st.sampled_from([[], ["Block"]])),
        "offload_optimizer": draw(st.sampled_from([None, "cpu", "disk"])),
    }
    if stage == 3:
        options |= {
            "units": draw(st.sampled_from([[], ["Block"], ["lm.blocks.*"], ["Block", "Embedding"]])),
            "unit_mb": draw(st.sampled_from([1e-6, 0.001, 16.0])),
            "prefetch": draw(st.integers(1, 4)),
            "reshard_after_forward": draw(st.booleans()),
            "verify_unit_order": draw(st.booleans()),
        }
        if options["offload_optimizer"] is not None:
            targets = ["cpu", "disk"] if options["offload_optimizer"] == "disk" else ["cpu"]
            options["offload_params"] = draw(st.sampled_from([None, *targets]))
    if options["offload_optimizer"] == "disk":
        options["offload_subgroup_mb"] = draw(st.sampled_from([1e-6, 0.001, 256.0]))
        options["offload_resident_subgroups"] = draw(st.integers(2, 4))
    timeout = draw(st.sampled_from([None, 1.0, 30.0]))
    options |= {"failure_timeout_s": timeout, "heartbeat_s": draw(st.sampled_from([0.01, 0.2, 0.5]))}
    return options, draw(st.sampled_from(["32-true", "bf16-mixed"]))


def _fit_each(cases: list[tuple[dict, str]], rank: int, world_size: int) -> list[dict]:
    results = []
    for options, precision in cases:
        recorder = Recorder()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = make_trainer(ZeroStrategy(**options), world_size, max_steps=STEPS, callbacks=[recorder],
                                   precision=precision)
            trainer.fit(TinyLM())
        results.append({"steps": trainer.global_step, "losses": recorder.losses, "params": recorder.params[-1]})
    return results


def _assert_all_trained(cases: list[tuple[dict, str]]) -> None:
    ranks = run_on_ranks(partial(_fit_each, cases), 2)
    for (options, precision), on0, on1 in zip(cases, *ranks):
        where = f"{options}, precision={precision!r}"
        assert on0["steps"] == on1["steps"] == STEPS, where
        assert len(on0["losses"]) == STEPS and all(math.isfinite(x) for x in on0["losses"] + on1["losses"]), where
        assert torch.equal(on0["params"], on1["params"]), f"the ranks diverged: {where}"
        assert torch.isfinite(on0["params"]).all(), where


@settings(**FIT_SETTINGS)
@given(cases=st.lists(fit_configurations(), min_size=10, max_size=10))
def test_generated_valid_configurations_train(cases):
    _assert_all_trained(cases)


@pytest.mark.slow
@settings(**FIT_SETTINGS)
@given(cases=st.lists(fit_configurations(), min_size=60, max_size=60))
def test_many_generated_valid_configurations_train(cases):
    _assert_all_trained(cases)
