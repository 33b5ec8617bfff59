"""Lean or fast memory ([Note: lean or fast memory] in memory_policy.py): decided from the model states' share of
the rank's budget, the largest over the ranks, and set where asked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from torch import nn

from lightning_zero import ZeroStrategy, memory, memory_policy, monitor
from lightning_zero.config import ZeroConfig
from lightning_zero.memory_policy import (
    LEAN_SHARE, before_steps, describe, lean_config, model_state_share, resolve_lean,
)
from lightning_zero.monitor import MonitorSummary, ZeroMonitor, format_report
from tests.unit.test_monitor import SUMMARY


class _Ranks:
    """Collectives of two ranks, the other one's share given: ``all_reduce_`` takes the max as gloo would."""

    device = torch.device("cpu")
    world_size = 2

    def __init__(self, other_share: float | None) -> None:
        self.other_share = other_share
        self.world = self

    def all_reduce_(self, tensor, what, op="sum"):
        if self.other_share is None:
            raise AssertionError(f"no collective expected, got one for {what}")
        assert op == "max"
        tensor.clamp_(min=self.other_share)


MODEL = nn.Linear(1000, 1000)  # 1,001,000 parameters
PSI = 1_001_000


@pytest.mark.parametrize(("stage", "precision", "per_element"), [
    (1, "32-true", 8 + 8 / 2), (2, "bf16-mixed", 2 + 14 / 2), (3, "32-true", 16 / 2),
])
def test_the_share_is_the_formula_of_the_stage_against_the_budget(stage, precision, per_element):
    share = model_state_share(ZeroConfig(stage=stage), MODEL, 2, precision, budget=10**9)
    assert share == pytest.approx(per_element * PSI / 10**9)


def test_frozen_parameters_hold_no_gradient_or_optimizer_state():
    frozen = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 1000))
    frozen[0].requires_grad_(False)
    share = model_state_share(ZeroConfig(stage=3), frozen, 2, "32-true", budget=10**9)
    assert share == pytest.approx((4 * 2 * PSI + 12 * PSI) / 2 / 10**9)


@pytest.mark.parametrize(("multiple", "lean"), [(4, True), (7.9, True), (8.1, False), (100, False)])
def test_lean_where_the_states_exceed_an_eighth_of_the_budget(monkeypatch, multiple, lean):
    states = 16 * PSI / 2
    monkeypatch.setattr(memory_policy, "memory_budget", lambda device, ranks: int(multiple * states))
    assert resolve_lean(ZeroConfig(stage=3), MODEL, _Ranks(other_share=0.0), "32-true", 2) is lean


def test_every_rank_decides_as_the_one_with_the_least_room(monkeypatch):
    monkeypatch.setattr(memory_policy, "memory_budget", lambda device, ranks: 10**12)  # this rank: fast
    assert not resolve_lean(ZeroConfig(stage=3), MODEL, _Ranks(other_share=0.0), "32-true", 2)
    assert resolve_lean(ZeroConfig(stage=3), MODEL, _Ranks(other_share=LEAN_SHARE * 1.01), "32-true", 2)


@pytest.mark.parametrize("given", [True, False])
def test_a_given_value_decides_without_a_collective(given):
    assert resolve_lean(ZeroConfig(stage=3, lean_memory=given), MODEL, _Ranks(None), "32-true", 2) is given


def test_disk_offload_is_always_lean(monkeypatch):
    monkeypatch.setattr(memory_policy, "memory_budget", lambda device, ranks: 10**15)
    config = ZeroConfig.from_options(stage=3, offload_optimizer="disk", offload_params="disk")
    assert resolve_lean(config, MODEL, _Ranks(None), "32-true", 2)


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_lean_memory_must_be_a_boolean_or_null(value):
    with pytest.raises(ValueError, match="lean_memory=.* is invalid: it must be true, false or null"):
        ZeroConfig(lean_memory=value)


def test_the_report_says_which_side_and_why():
    assert describe(False, ZeroConfig(stage=3)) == (
        "fast (buffers and freed memory kept for speed): the model states are at most 1/8 of the memory budget")
    assert describe(True, ZeroConfig(stage=3)) == (
        "lean (what ZeRO's formulas say): the model states are over 1/8 of the memory budget")
    assert describe(True, ZeroConfig(stage=3, lean_memory=True)).endswith(": lean_memory=True")
    disk = ZeroConfig.from_options(stage=3, offload_optimizer="disk", offload_params="disk")
    assert describe(True, disk).endswith(": disk offload")


class _Libc:
    """The C library's ``mallopt``, recording what it is given."""

    def __init__(self) -> None:
        self.settings: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.settings.append((param, value))
        return 1


M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -3, -1  # malloc.h
GLIBC_DEFAULT = 128 << 10  # mallopt(3): both thresholds


@pytest.fixture
def libc(monkeypatch) -> _Libc:
    """A recording C library, and a process that has changed no ``mallopt`` setting yet."""
    recording = _Libc()
    monkeypatch.setattr(memory, "_libc", lambda: recording)
    monkeypatch.setattr(memory, "_made", {})
    for name in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    return recording


@pytest.mark.parametrize(("options", "lean", "settings"), [
    # lean: every block of 1 MiB or more mapped afresh, handed back at once
    (dict(stage=3), True, [(M_MMAP_THRESHOLD, 1 << 20)]),
    # fast: blocks under 32 MiB from the heap, whose top is never cut back (no page faults from step to step)
    (dict(stage=3), False, [(M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 2**31 - 1)]),
    (dict(stage=1, offload_optimizer="cpu"), False, [(M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 2**31 - 1)]),
    # zero1 and zero2 in memory keep glibc's own thresholds, as DDP runs with them
    (dict(stage=2), True, []),
    (dict(stage=2), False, []),
])
def test_each_side_sets_glibcs_heap_up_on_a_cpu_device(libc, options, lean, settings):
    config = lean_config(ZeroConfig.from_options(lean_memory=lean, **options), MODEL, _Ranks(None), "32-true", 2)
    assert config.lean_memory is lean
    # the lean side's threshold holds through setup; the fast side keeps the heap only once setup is done
    assert libc.settings == (settings if lean else [])
    before_steps(config, _Ranks(None))
    assert libc.settings == settings


def _fast_zero3_set_up() -> None:
    config = lean_config(ZeroConfig.from_options(stage=3, lean_memory=False), MODEL, _Ranks(None), "32-true", 2)
    before_steps(config, _Ranks(None))


def _torn_down() -> None:
    strategy = ZeroStrategy(stage=3, accelerator=CPUAccelerator(), cluster_environment=LightningEnvironment())
    strategy.teardown()


def test_teardown_gives_glibc_back_the_values_it_started_with(libc):
    _fast_zero3_set_up()
    made = len(libc.settings)
    _torn_down()
    assert libc.settings[made:] == [(M_MMAP_THRESHOLD, GLIBC_DEFAULT), (M_TRIM_THRESHOLD, GLIBC_DEFAULT)]
    assert memory.glibc_heap_settings() == {}
    _torn_down()  # nothing set since: nothing restored again
    assert len(libc.settings) == made + 2


def test_teardown_restores_what_the_environment_gave_glibc(libc, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=262144")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    _fast_zero3_set_up()
    memory.restore_glibc_heap()
    assert libc.settings[-2:] == [(M_MMAP_THRESHOLD, 262144), (M_TRIM_THRESHOLD, 1000000)]


def test_the_run_report_names_the_settings(libc, monkeypatch):
    _fast_zero3_set_up()
    run = ZeroMonitor()
    run._steps, run._held = [None], (0,) * 6  # a finished run, as far as on_train_end looks
    monkeypatch.setattr(monitor, "_summarize", lambda *args: SUMMARY)
    run.on_train_end(SimpleNamespace(strategy=SimpleNamespace()), None)
    assert run.summary.glibc_heap == {"M_MMAP_THRESHOLD": 32 << 20, "M_TRIM_THRESHOLD": 2**31 - 1}
    assert MonitorSummary.from_json(run.summary.to_json()) == run.summary
    assert "  glibc's heap (mallopt, process-wide until teardown): M_MMAP_THRESHOLD=33554432, " \
           "M_TRIM_THRESHOLD=2147483647" in format_report(run.summary).splitlines()
    assert "glibc" not in format_report(SUMMARY)  # none set: no line
