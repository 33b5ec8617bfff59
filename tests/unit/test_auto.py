"""``strategy=auto`` (lightning_zero.auto): the choice against a CPU budget, the hand-over to re-run ranks, bad
input."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy, auto, config
from lightning_zero.auto import AUTO_ENV, AutoChoice, AutoStrategy, AutoStrategyError
from lightning_zero.host_memory import HostMemory
from lightning_zero.models.language_model import ParameterCounts

PSI = ParameterCounts(total=1000, trainable=1000)
KIB = 2**-20  # one KiB in GiB (budget_gb, reserve_gb)
BUCKET_MB = 2**-10  # one KiB in MiB (bucket_mb)


DISK_FREE = 64 * 2**30  # what every test's offload directory has free, whatever the machine running it has


@pytest.fixture(autouse=True)
def _no_inherited_choice(monkeypatch):
    monkeypatch.delenv(AUTO_ENV, raising=False)


@pytest.fixture(autouse=True)
def _machine(monkeypatch):
    """The offload directory's free space and the host memory available, fixed: the choice must not depend on the
    test machine's disk or memory (a test's own fixture may set them otherwise)."""
    real = auto.shutil.disk_usage

    def disk_usage(path):
        return real(path)._replace(free=DISK_FREE)  # real() raises for a directory that does not exist

    monkeypatch.setattr(auto.shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(auto, "host_memory", lambda: HostMemory(64 * 2**30, "MemAvailable"))


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
    assert choice.reason == ("zero3: the least complex option that fits (4.91 KiB of 5.00 KiB per rank); host budget: "
                             "64.00 GiB free (MemAvailable), shared by 2 ranks")


def test_on_cpu_the_default_budget_is_the_host_budget_of_the_jobs_cgroup(monkeypatch):
    # A 3 GiB cgroup with 0.25 GiB in use, on a host with 64 GiB available: 1.375 GiB per rank for 2 ranks. fp32,
    # Ψ = 1.2e8: DDP's 16Ψ (1.79 GiB) does not fit, zero1's 12Ψ and a 25 MiB bucket (1.37 GiB) does.
    cgroup = HostMemory(int(2.75 * 2**30), "cgroup v1 /sys/fs/cgroup/memory/job: limit 3.00 GiB less 0.25 GiB in use")
    monkeypatch.setattr(auto, "host_memory", lambda: cgroup)
    choice = auto.choose(AutoStrategy(), ParameterCounts(12 * 10**7, 12 * 10**7), "32-true", accelerator="cpu",
                         devices=2)
    assert choice.option == "zero1"
    assert choice.reason == (
        "zero1: the least complex option that fits (1.37 GiB of 1.38 GiB per rank); host budget: 2.75 GiB free "
        "(cgroup v1 /sys/fs/cgroup/memory/job: limit 3.00 GiB less 0.25 GiB in use), shared by 2 ranks"
    )


def test_nothing_fits_names_the_ranks_that_would():
    # zero3 holds 16000/N + 1024 bytes: 9024 on 2 ranks, 5024 <= 5120 on 4.
    expected = (r"^strategy=auto: nothing fits: zero3 needs .* zero3 fits on 4 ranks or more; host budget: 64.00 GiB free "
                r"\(MemAvailable\), shared by 2 ranks$")
    with pytest.raises(AutoStrategyError, match=expected):
        auto.choose(AutoStrategy(budget_gb=5 * KIB, bucket_mb=BUCKET_MB, offload=False), PSI, "32-true",
                    accelerator="cpu", devices=2)


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
    assert auto.available_options(offload=False) == ("ddp", "zero1", "zero2", "zero3")
    assert auto.available_options() == (
        "ddp", "zero1", "zero2", "zero3", "zero1_offload", "zero2_offload", "zero3_offload", "zero3_offload_params",
        "zero1_offload_disk", "zero2_offload_disk", "zero3_offload_disk",
    )
    disk = auto.build("zero3_offload_disk", AutoStrategy(offload_dir="/somewhere"))
    assert disk.config.offload == config.OffloadConfig(
        offload_optimizer="disk", offload_params="disk", offload_dir="/somewhere"
    )
    host = auto.build("zero3_offload_params", settings).config
    assert (host.stage, host.offload.offload_optimizer, host.offload.offload_params) == (3, "cpu", "cpu")


@pytest.mark.parametrize(("devices", "indexes"), [(2, [0, 1]), ("3", [0, 1, 2]), ("auto", [0])])
def test_run_devices_on_cpu(devices, indexes):
    assert auto.run_devices("cpu", devices) == indexes


@pytest.mark.parametrize(("devices", "indexes"), [(2, [0, 1]), ([1], [1]), ("1,", [1]), (-1, [0, 1]), ("auto", [0, 1])])
def test_run_devices_on_cuda(two_gpus, devices, indexes):
    assert auto.run_devices("cuda", devices) == indexes


@pytest.mark.parametrize(
    ("on_cuda", "devices", "reason"),
    [
        # As the Trainer refuses them: a CPU run takes a count, not indexes, and only existing GPUs can be named.
        (False, "abc", "`devices` selected with `CPUAccelerator` should be an int > 0."),
        (False, 0, "`devices` selected with `CPUAccelerator` should be an int > 0."),
        (False, "-1", "`devices` selected with `CPUAccelerator` should be an int > 0."),
        (False, 2.5, "`devices` selected with `CPUAccelerator` should be an int > 0."),
        (False, [1, 3], "`devices` selected with `CPUAccelerator` should be an int > 0."),
        (True, [1, 3], "You requested gpu: [1, 3]"),
        (True, 0, "it selects no device"),
        (True, "auto", "it selects no device"),  # no GPU visible: the message keeps the value given
    ],
)
def test_run_devices_refuses_what_the_trainer_refuses(request, monkeypatch, on_cuda, devices, reason):
    if on_cuda:
        request.getfixturevalue("two_gpus")
        if devices == "auto":
            monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(AutoStrategyError) as refused:
        auto.run_devices("cuda" if on_cuda else "cpu", devices)
    assert str(refused.value) == f"trainer.devices={devices!r} is invalid: {reason}"


def test_a_bad_node_count_is_refused():
    with pytest.raises(AutoStrategyError, match=r"^trainer.num_nodes='2' is invalid: it must be an int > 0$"):
        auto.choose(AutoStrategy(), PSI, "32-true", accelerator="cpu", devices=2, num_nodes="2")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget_gb": float("inf")}, "budget_gb=inf is invalid: it must be a finite number of GiB > 0"),
        ({"budget_gb": float("nan")}, "budget_gb=nan is invalid: it must be a finite number of GiB > 0"),
        ({"budget_gb": 0}, "budget_gb=0 is invalid: it must be a finite number of GiB > 0"),
        ({"budget_gb": "4"}, "budget_gb='4' is invalid: it must be a finite number of GiB > 0"),
        ({"reserve_gb": -1.0}, "reserve_gb=-1.0 is invalid: it must be a finite number of GiB >= 0"),
        ({"bucket_mb": float("inf")}, "bucket_mb=inf is invalid: it must be a finite number of MiB > 0"),
        ({"link_gbps": 0}, "link_gbps=0 is invalid: it must be a finite number of Gbit/s > 0"),
        ({"step_s": -1.0}, "step_s=-1.0 is invalid: it must be a finite number of seconds > 0"),
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


# ------------------------------------------------------------------------------------------------------- offload
BILLION = ParameterCounts(total=10**9, trainable=10**9)
GIB = 2**30


@pytest.fixture
def two_gpus(monkeypatch):
    """A CUDA run on 2 devices with 6 GiB free each and 40 GiB of host memory available, without a GPU."""
    from lightning.fabric.accelerators import cuda

    monkeypatch.setattr(auto, "_on_cuda", lambda accelerator: True)
    monkeypatch.setattr(cuda, "_get_all_visible_cuda_devices", lambda: [0, 1])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(auto, "cuda_free_bytes", lambda device: 6 * GIB)
    monkeypatch.setattr(auto, "host_memory", lambda: HostMemory(40 * GIB, "MemAvailable"))


def test_on_cuda_host_offload_comes_after_the_device_and_before_disk(two_gpus, tmp_path):
    # 10^9 parameters, 16-bit, 2 ranks: zero3 needs 16Ψ/2 = 7.45 GiB > 6 GiB. zero1_offload keeps 2Ψ + 2Ψ = 3.73 GiB on
    # the device and needs 12Ψ/2 = 5.59 GiB of host states plus 2 x 2Ψ/2 = 1.86 GiB of staging: 7.45 GiB, within the
    # 40/2 = 20 GiB each rank gets of host memory.
    choice = auto.choose(AutoStrategy(offload_dir=str(tmp_path)), BILLION, "bf16-mixed", accelerator="cuda",
                         devices=[0, 1])
    assert choice.option == "zero1_offload"
    assert choice.reason.startswith(
        "zero1_offload: the least complex option that fits (3.75 GiB of 6.00 GiB on the device, 7.45 GiB of 20.00 GiB "
        "of host memory per rank); nothing without offload fits (zero3 needs 7.47 GiB of 6.00 GiB on the device"
    )
    # With 7 GiB of host memory per rank no host offload fits (zero3_offload_params: 14Ψ/2 + 2Ψ/2 = 7.45 GiB), and
    # zero1_offload_disk keeps 2 sub-groups of 256 MiB of masters resident (three of the largest would pass a quarter
    # of the host budget): 2 x 256 MiB x 3 + 1.86 GiB of staging = 3.36 GiB.
    choice = auto.choose(AutoStrategy(host_budget_gb=7.0, offload_dir=str(tmp_path)), BILLION, "bf16-mixed",
                         accelerator="cuda", devices=[0, 1])
    assert choice.option == "zero1_offload_disk"
    assert "3.36 GiB of 7.00 GiB of host memory" in choice.reason
    assert "nothing with host offload fits (zero3_offload_params needs" in choice.reason


def test_disk_offload_is_not_offered_without_its_directory(two_gpus, tmp_path):
    settings = AutoStrategy(host_budget_gb=7.0, offload_dir=str(tmp_path / "missing"))
    with pytest.raises(AutoStrategyError, match=r"^strategy=auto: nothing fits: zero3_offload_params needs "):
        auto.choose(settings, BILLION, "bf16-mixed", accelerator="cuda", devices=[0, 1])


def test_on_cpu_only_disk_offload_lowers_what_a_rank_holds(tmp_path):
    # fp32, 10^9 parameters, 2 ranks, 25 MiB bucket: zero3 holds 16Ψ/2 + 25 MiB = 7.47 GiB. The device is host memory,
    # so host offload adds to it (and stages nothing: the gradients are host memory already). Disk offload keeps the
    # gradient shards of stages 2 and 3 in files and sizes its resident sub-groups from a quarter of the budget
    # (offload/sizing.py): zero2_offload_disk holds the parameters (4Ψ = 3.73 GiB), the bucket and 2 sub-groups of
    # 224 MiB of masters with their moments and gradients (2 x 224 MiB x 16/4 = 1.75 GiB).
    settings = AutoStrategy(budget_gb=7.0, offload_dir=str(tmp_path))
    choice = auto.choose(settings, BILLION, "32-true", accelerator="cpu", devices=2)
    assert choice.option == "zero2_offload_disk"
    assert choice.reason.startswith(
        "zero2_offload_disk: the least complex option that fits (5.50 GiB of 7.00 GiB of memory (device and host are "
        "one), 7.45 GiB of 32.00 GiB on disk per rank"
    )
    # With 4 GiB, zero3_offload_disk: the bucket and 2 sub-groups of 102.4 MiB of masters with their moments,
    # parameter rows and gradients (2 x 102.4 MiB x 20/4 = 1 GiB); 20Ψ/2 of files.
    choice = auto.choose(AutoStrategy(budget_gb=4.0, offload_dir=str(tmp_path)), BILLION, "32-true",
                         accelerator="cpu", devices=2)
    assert choice.option == "zero3_offload_disk"
    assert choice.reason.startswith(
        "zero3_offload_disk: the least complex option that fits (1.02 GiB of 4.00 GiB of memory (device and host are "
        "one), 9.31 GiB of 32.00 GiB on disk per rank"
    )
    with pytest.raises(AutoStrategyError, match=r"^strategy=auto: nothing fits: zero3 needs 7.47 GiB per rank"):
        auto.choose(AutoStrategy(budget_gb=7.0, offload=False), BILLION, "32-true", accelerator="cpu", devices=2)


def test_disk_offload_needs_the_disk_for_each_local_rank(monkeypatch, tmp_path):
    # zero3_offload_disk on a host writes 12Ψ/2 + 4Ψ/2 + 4Ψ/2 bytes (states, parameter and gradient shards), 9.31 GiB a
    # rank: 14.80 GiB free for 2 ranks is 7.40 GiB each, too little; 3 ranks would write 6.21 GiB each.
    monkeypatch.setattr(sys.modules[__name__], "DISK_FREE", int(14.8 * 2**30))
    settings = AutoStrategy(budget_gb=7.0, offload_dir=str(tmp_path))
    with pytest.raises(AutoStrategyError, match=r"9.31 GiB of 7.40 GiB on disk per rank on 2 ranks; zero3_offload_disk "
                                                r"fits on 3 ranks or more; host budget: "):
        auto.choose(settings, BILLION, "32-true", accelerator="cpu", devices=2)


def test_bad_offload_settings_name_the_field():
    with pytest.raises(AutoStrategyError, match=r"^host_budget_gb=0 is invalid: it must be a finite number of GiB > 0"):
        AutoStrategy(host_budget_gb=0)
    with pytest.raises(AutoStrategyError, match=r"^offload='yes' is invalid: it must be true or false$"):
        AutoStrategy(offload="yes")
    with pytest.raises(AutoStrategyError, match=r"^offload_dir='' is invalid: it must be a directory path$"):
        AutoStrategy(offload_dir="")


def test_with_a_measured_step_auto_chooses_from_the_whole_peak(monkeypatch):
    from lightning_zero import estimate
    from lightning_zero.models import GPTConfig, LanguageModel
    from lightning_zero.step_measure import StepMeasure

    step = StepMeasure(baseline=0, activation_per_sample=8000, activation_fixed=0, unit_elements=100,
                       root_unit_elements=0)
    calls = []
    monkeypatch.setattr("lightning_zero.step_measure.measure_step", lambda *args: calls.append(args) or step)
    model = LanguageModel(GPTConfig(vocab_size=32, n_layer=1, n_head=1, d_model=8, seq_len=16))
    # Model states alone, ddp's 16,000 bytes fit 17,000. From the peak (2 sequences of 8,000 bytes of activations,
    # Adam's workspace of 4 bytes per element it updates) against 30,000: ddp 16,000 + 16,000 + 4,000 and zero1
    # 13,024 + 16,000 + 2,000 do not fit, zero2 11,024 + 16,000 + 2,000 does.
    assert auto.choose(AutoStrategy(budget_gb=17000 / 2**30, bucket_mb=BUCKET_MB, offload=False), PSI, "32-true",
                       "cpu", 2).option == "ddp"
    measuring = AutoStrategy(budget_gb=30000 / 2**30, bucket_mb=BUCKET_MB, offload=False, measure=True)
    inputs = auto.measured_step(measuring, model, batch_size=2, seq_len=16, accelerator="cpu")
    assert calls and calls[0][1:3] == (32, 16) and inputs == estimate.PeakInputs(step, 2, eager=False)
    choice = auto.choose(measuring, PSI, "32-true", "cpu", 2, step=inputs)
    assert choice.option == "zero2"
    assert auto.measured_step(AutoStrategy(), model, 2, 16) is None  # measure=False: nothing runs


SMALL_GPT = ParameterCounts(total=842_496, trainable=842_496)


@pytest.mark.parametrize(("gbps", "option", "settings"), [
    (1.0, "ddp", ()),
    (0.04, "zero1", ()),  # zero3 with ZeRO++ within 5% of it: the less complex wins
    (0.01, "zero3", (("quantize_weights", True), ("hpz_group_size", "node"), ("quantize_grads", "int4"))),
])
def test_between_nodes_the_link_chooses_the_layout(gbps, option, settings):
    strategy = AutoStrategy(budget_gb=4, link_gbps=gbps, step_s=1.3)
    choice = auto.choose(strategy, SMALL_GPT, "32-true", accelerator="cpu", devices=2, num_nodes=2)
    assert (choice.option, choice.settings) == (option, settings)
    assert f"between 2 nodes at {gbps:g} Gbit/s and 1.3 s of compute a step" in choice.reason
    built = auto.build(choice.option, strategy, choice.settings)
    if option != "ddp":
        assert built.config.stage == int(option[-1])
        assert built.config.comm.quantize_grads == dict(settings).get("quantize_grads")
        assert built.config.topology.hpz_group_size == dict(settings).get("hpz_group_size")


def test_between_nodes_hybrid_sharding_needs_the_memory_of_one_node():
    # 9 MB a rank: only zero3 fits (3.37 MB of states and a bucket as large at 4 ranks; hpZ's secondaries add 1.68 MB);
    # hybrid sharding would hold a world of 2's states (10.1 MB), so at 40 Mbit/s, where it would win the near tie
    # with ZeRO++, ZeRO++ is chosen.
    strategy = AutoStrategy(budget_gb=9e6 / 2**30, link_gbps=0.04, step_s=1.3, offload=False)
    choice = auto.choose(strategy, SMALL_GPT, "32-true", accelerator="cpu", devices=2, num_nodes=2)
    assert (choice.option, dict(choice.settings)["quantize_grads"]) == ("zero3", "int4")
    assert "zero3 hybrid" not in choice.reason and "zero3 flat" in choice.reason
    roomy = AutoStrategy(budget_gb=11e6 / 2**30, link_gbps=0.04, step_s=1.3, offload=False)  # zero2 fits too
    choice = auto.choose(roomy, SMALL_GPT, "32-true", accelerator="cpu", devices=2, num_nodes=2)
    assert choice.option == "zero2" and "zero3 hybrid (shard_group_size='node')" in choice.reason


def test_the_link_needs_the_steps_compute_time():
    strategy = AutoStrategy(budget_gb=4, link_gbps=0.04)
    with pytest.raises(AutoStrategyError) as err:
        auto.choose(strategy, SMALL_GPT, "32-true", accelerator="cpu", devices=2, num_nodes=2)
    assert str(err.value) == ("strategy.link_gbps needs the step's compute time: set strategy.measure=true (one step "
                              "is timed) or strategy.step_s (seconds a rank computes one step)")
    # One node: nothing crosses, the link is not considered.
    assert auto.choose(strategy, SMALL_GPT, "32-true", accelerator="cpu", devices=2).settings == ()


def test_the_layout_travels_to_rerun_ranks(monkeypatch):
    choice = AutoChoice("zero3", "why", (("quantize_weights", True), ("hpz_group_size", "node"), ("prefetch", 2)))
    with auto.shared_with_ranks(choice):
        assert os.environ[AUTO_ENV] == "zero3 quantize_weights=True hpz_group_size=node prefetch=2"
        inherited = auto.choose(AutoStrategy(), None, "32-true", accelerator="cpu", devices=2)
    assert inherited == AutoChoice("zero3", None, choice.settings)


def test_between_nodes_the_measured_step_gives_the_compute():
    from lightning_zero import estimate
    from lightning_zero.step_measure import StepMeasure

    step = StepMeasure(baseline=0, activation_per_sample=1000, activation_fixed=0, unit_elements=200_000,
                       root_unit_elements=50_000, seconds_per_sample=1.3 / 32)
    assert step.compute_s(32) == pytest.approx(1.3)
    measuring = AutoStrategy(budget_gb=4, link_gbps=0.01, measure=True)
    choice = auto.choose(measuring, SMALL_GPT, "32-true", "cpu", 2, num_nodes=2, step=estimate.PeakInputs(step, 32))
    assert choice.option == "zero3" and "and 1.3 s of compute a step" in choice.reason
