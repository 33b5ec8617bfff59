"""``strategy=auto`` (lightning_zero.auto): the choice against a CPU budget, the hand-over to re-run ranks, bad
input."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy, auto
from lightning_zero.auto import AUTO_ENV, AutoChoice, AutoStrategy, AutoStrategyError
from lightning_zero.models.language_model import ParameterCounts

PSI = ParameterCounts(total=1000, trainable=1000)
KIB = 2**-20  # one KiB in GiB (budget_gb, reserve_gb)
BUCKET_MB = 2**-10  # one KiB in MiB (bucket_mb)


@pytest.fixture(autouse=True)
def _no_inherited_choice(monkeypatch):
    monkeypatch.delenv(AUTO_ENV, raising=False)


@pytest.mark.parametrize(
    # fp32 Adam, Ψ = 1000, 2 CPU ranks, a 1 KiB bucket (ZeRO options only): ddp 16000 bytes, zero1 8000 + 4000 + 1024,
    # zero2 4000 + 6000 + 1024, zero3 8000 + 1024.
    ("budget_bytes", "option"),
    [(16000, "ddp"), (15999, "zero1"), (13024, "zero1"), (13023, "zero2"), (11024, "zero2"), (11023, "zero3")],
)
def test_choose_picks_the_least_complex_option_within_the_cpu_budget(budget_bytes, option):
    strategy = AutoStrategy(budget_gb=budget_bytes / 2**30, bucket_mb=BUCKET_MB)
    choice = auto.choose(strategy, PSI, "32-true", accelerator="cpu", devices=2)
    assert choice.option == option
    assert choice.reason.startswith(f"{option}: the least complex option that fits")


def test_reserve_and_nodes_count():
    # 4 ranks (2 devices x 2 nodes): zero3 holds 16000/4 + 1024 = 5024 bytes; a 6 KiB budget less 1 KiB leaves 5120
    # (on 2 ranks nothing would fit: zero3 needs 9024).
    strategy = AutoStrategy(budget_gb=6 * KIB, reserve_gb=KIB, bucket_mb=BUCKET_MB)
    choice = auto.choose(strategy, PSI, "32-true", accelerator="cpu", devices=2, num_nodes=2)
    assert choice.option == "zero3"
    assert choice.reason == "zero3: the least complex option that fits (4.91 KiB of 5.00 KiB per rank)"


def test_nothing_fits_names_the_ranks_that_would():
    # zero3 holds 16000/N + 1024 bytes: 9024 on 2 ranks, 5024 <= 5120 on 4.
    expected = r"^strategy=auto: nothing fits: zero3 needs .* zero3 fits on 4 ranks or more$"
    with pytest.raises(AutoStrategyError, match=expected):
        auto.choose(AutoStrategy(budget_gb=5 * KIB, bucket_mb=BUCKET_MB), PSI, "32-true", accelerator="cpu", devices=2)


def test_a_rerun_rank_takes_the_launching_process_choice(monkeypatch):
    # No parameter count and a budget nothing fits: a rank must not choose again, only read the choice.
    monkeypatch.setenv(AUTO_ENV, "zero2")
    choice = auto.choose(AutoStrategy(budget_gb=KIB), None, "32-true", accelerator="cpu", devices=2)
    assert choice == AutoChoice("zero2", None)


def test_the_choice_is_in_the_environment_only_while_the_ranks_run():
    with auto.shared_with_ranks(AutoChoice("zero1", "why")):
        assert os.environ[AUTO_ENV] == "zero1"
    assert AUTO_ENV not in os.environ
    with auto.shared_with_ranks(None):
        assert AUTO_ENV not in os.environ


def test_build_gives_the_chosen_strategy_with_the_auto_settings():
    settings = AutoStrategy(bucket_mb=7.0, start_method="fork")
    zero = auto.build("zero3", settings)
    assert isinstance(zero, ZeroStrategy)
    assert (zero.config.stage, zero.config.comm.bucket_mb, zero._start_method) == (3, 7.0, "fork")
    ddp = auto.build("ddp", settings)
    assert type(ddp) is DDPStrategy and ddp._start_method == "fork"
    assert auto.available_options() == ("ddp", "zero1", "zero2", "zero3")


@pytest.mark.parametrize(("devices", "indexes"), [(2, [0, 1]), ([1, 3], [1, 3]), ("auto", [0]), ("-1", [0])])
def test_run_devices_on_cpu(devices, indexes):
    assert auto.run_devices("cpu", devices) == indexes


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget_gb": float("inf")}, "budget_gb=inf is invalid: it must be a finite number of GiB > 0"),
        ({"budget_gb": float("nan")}, "budget_gb=nan is invalid: it must be a finite number of GiB > 0"),
        ({"budget_gb": 0}, "budget_gb=0 is invalid: it must be a finite number of GiB > 0"),
        ({"budget_gb": "4"}, "budget_gb='4' is invalid: it must be a finite number of GiB > 0"),
        ({"reserve_gb": -1.0}, "reserve_gb=-1.0 is invalid: it must be a finite number of GiB >= 0"),
        ({"bucket_mb": float("inf")}, "bucket_mb=inf is invalid: it must be a finite number of MiB > 0"),
    ],
)
def test_bad_settings_name_the_field(kwargs, message):
    with pytest.raises(AutoStrategyError, match="^" + message.replace("(", r"\(") + "$"):
        AutoStrategy(**kwargs)


def test_a_reserve_larger_than_the_budget_is_refused():
    with pytest.raises(AutoStrategyError, match=r"^strategy.reserve_gb=2.0 is invalid: it leaves no memory"):
        auto.choose(AutoStrategy(budget_gb=1.0, reserve_gb=2.0), PSI, "32-true", accelerator="cpu", devices=2)


def test_unsupported_precision_and_unknown_size_are_refused():
    with pytest.raises(AutoStrategyError, match=r"^trainer.precision='64-true' is not supported by strategy=auto: "
                       "allowed values are 32-true, bf16-mixed, 16-mixed$"):
        auto.choose(AutoStrategy(), PSI, "64-true", accelerator="cpu", devices=2)
    with pytest.raises(AutoStrategyError, match=r"^strategy=auto needs the model's parameter count"):
        auto.choose(AutoStrategy(), None, "32-true", accelerator="cpu", devices=2)
