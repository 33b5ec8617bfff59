"""`lightning-zero` end to end: train (in-process with forked ranks, and as a real command), estimate, bad input.

In-process runs use ``strategy.start_method=fork``: the ``popen`` launcher re-runs ``sys.argv``, which inside pytest
is pytest itself. The ``popen`` path is covered by the subprocess tests, which run ``python -m lightning_zero.cli``.
"""

from __future__ import annotations

import csv
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero import config, estimate
from lightning_zero.cli import CONF_DIR, RECIPES_DIR, main
from lightning_zero.cli.train import _check_precision
from lightning_zero.models import GPTConfig
from lightning_zero.monitor import MonitorSummary

REPO = Path(__file__).resolve().parents[2]
TINY_GPT = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=32)
TINY = [
    "model=gpt_tiny",
    "seq_len=32",
    "data.batch_size=4",
    "data.max_bytes=60000",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def train_in_process(run_dir: Path, *overrides: str) -> int:
    return main(["train", *TINY, "strategy.start_method=fork", f"hydra.run.dir={run_dir}", *overrides])


def summary_of(run_dir: Path) -> MonitorSummary:
    return MonitorSummary.from_json((run_dir / "zero_monitor.json").read_text())


def run_command(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_zero.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


# ------------------------------------------------------------------------------------------------------ training


@pytest.mark.parametrize(
    ("strategy", "vs_ddp"),
    # Model states per rank against DDP's 16Ψ in fp32 on 2 ranks: zero1 (8 + 8/2)/16, zero2 (4 + 12/2)/16, zero3 8/16.
    [("ddp", 1.0), ("zero1", 0.75), ("zero2", 0.625), ("zero3", 0.5)],
)
def test_train_reports_memory_and_communication(tmp_path, capfd, strategy, vs_ddp):
    assert train_in_process(tmp_path, f"strategy={strategy}") == 0
    out = capfd.readouterr().out
    assert f"Run report: {strategy} on 2 x cpu, precision 32-true" in out
    assert "val_loss" in out and "val_ppl" in out

    psi = TINY_GPT.num_parameters
    s = summary_of(tmp_path)
    assert (s.option, s.world_size, s.steps, s.num_params) == (strategy, 2, 3, psi)
    assert s.ddp == (4 * psi, 4 * psi, 8 * psi)
    for measured, modelled in zip(s.held, s.predicted):  # the Adam `step` counters are the only extra
        assert modelled <= measured <= modelled * 1.01
    assert sum(s.held) / sum(s.ddp) == pytest.approx(vs_ddp, rel=0.01)
    assert float(re.search(r"measured / DDP: ([\d.]+)x", out).group(1)) == pytest.approx(vs_ddp, abs=0.006)
    assert s.throughput > 0 and s.throughput_unit == "tokens/s"
    if strategy == "ddp":
        assert s.comm_bytes_per_step is None  # DDPStrategy keeps no byte accounting
        assert s.memory_mode is None
        return
    # a tiny model on a host of GiBs: the fast side, said in the report
    assert "  memory between steps: fast (buffers and freed memory kept for speed): the model states are at most " \
           "1/8 of the memory budget" in out
    # Per step, 2Ψ(N-1)/N fp32 elements for zero1/2 (reduce-scatter gradients, all-gather parameters) and up to
    # 3Ψ(N-1)/N for zero3, which also gathers parameters again for backward unless a unit stays gathered.
    assert s.ideal_comm_bytes_per_step == (6 if strategy == "zero3" else 4) * psi
    low = 4 * psi
    assert low * 0.99 <= s.comm_bytes_per_step <= s.ideal_comm_bytes_per_step * 1.02
    with open(next(tmp_path.glob("lightning_logs/version_*/metrics.csv"))) as f:
        logged = [float(r["zero/comm_bytes_per_step"]) for r in csv.DictReader(f) if r["zero/comm_bytes_per_step"]]
    assert logged and logged[-1] == pytest.approx(s.comm_bytes_per_step, rel=1e-6)


def _report_losses(out: str) -> dict[str, float]:
    line = next(line for line in out.splitlines() if line.startswith("  train_loss"))
    return dict(zip(line.split()[::2], map(float, line.split()[1::2])))


def test_zero3_trains_like_ddp(tmp_path, capfd):
    losses = {}
    for strategy, extra in (("ddp", []), ("zero3", ["strategy.units=[Block]"])):
        assert train_in_process(tmp_path / strategy, f"strategy={strategy}", *extra) == 0
        losses[strategy] = _report_losses(capfd.readouterr().out)
    assert losses["zero3"]["train_loss"] == pytest.approx(losses["ddp"]["train_loss"], rel=1e-5)
    assert losses["zero3"]["val_loss"] == pytest.approx(losses["ddp"]["val_loss"], rel=1e-5)


def test_validation_perplexity_is_exp_of_loss(tmp_path, capfd):
    assert train_in_process(tmp_path) == 0
    values = _report_losses(capfd.readouterr().out)
    assert values["val_ppl"] == pytest.approx(2.718281828 ** values["val_loss"], rel=1e-3)
    assert 4.0 < values["val_loss"] < 6.0  # ln(256) = 5.55 for a model that has barely started


def test_auto_strategy_picks_the_least_complex_option_that_fits(tmp_path, capfd):
    # Tiny GPT, 2 ranks, 10 KiB buckets: ddp needs 16Ψ = 604,160 B, zero1 12Ψ + 10,485 = 463,605 B.
    assert train_in_process(tmp_path, "strategy=auto", "strategy.bucket_mb=0.01", "strategy.budget_gb=0.00045") == 0
    captured = capfd.readouterr()
    assert "strategy=auto chose zero1: the least complex option that fits" in captured.err
    assert summary_of(tmp_path).option == "zero1"


@pytest.mark.parametrize(
    ("strategy", "device", "host", "disk"),
    [
        # fp32 on 2 ranks: ZeRO-Offload stage 2 keeps 4Ψ + 4Ψ/2 on the device and puts 12Ψ/2 on the host.
        ("zero2_offload", 6, 6, 0),
        # Disk offload at stage 3 on CPU: everything in files, 12Ψ/2, the parameter shards 4Ψ/2 and the gradient shards 4Ψ/2.
        ("zero3_offload_disk", 0, 0, 10),
    ],
)
def test_train_with_offload_reports_where_each_byte_lives(tmp_path, capfd, strategy, device, host, disk):
    extra = [f"strategy.offload_dir={tmp_path}"] if strategy.endswith("disk") else []
    assert train_in_process(tmp_path / "run", f"strategy={strategy}", *extra) == 0
    out = capfd.readouterr().out
    assert f"Run report: {strategy} on 2 x cpu, precision 32-true" in out
    psi = TINY_GPT.num_parameters
    s = summary_of(tmp_path / "run")
    assert s.option == strategy
    assert s.predicted_placement == (device * psi, host * psi, disk * psi)
    for measured, modelled in zip(s.placement, s.predicted_placement):  # Adam's step counters live on the host
        assert modelled <= measured <= modelled * 1.01 + 200
    fmt = estimate.format_bytes
    assert f"  where they live per rank: device {fmt(s.placement[0])}, host {fmt(s.placement[1])}, " in out
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # disk offload removed its files


def test_command_line_launches_ranks_with_popen_into_one_output_directory(tmp_path):
    result = run_command("train", *TINY, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Run report: zero3 on 2 x cpu" in result.stdout
    assert result.stdout.count("Run report") == 1  # printed by rank 0 only
    run = tmp_path / "run"
    assert {"train.log", "train_ddp_process_1.log", "zero_monitor.json"} <= {p.name for p in run.iterdir()}
    assert summary_of(run).world_size == 2
    assert not (tmp_path / "outputs").exists()


# ------------------------------------------------------------------------------------------------------- recipes

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def test_the_repository_root_holds_the_config_tree_the_command_offers(capfd):
    # conf/ and recipes/ are real folders at the root (the wheel maps them into the package), not links to it.
    for folder in ("conf", "recipes"):
        assert (REPO / folder).is_dir() and not (REPO / folder).is_symlink()
    assert not (REPO / "lightning_zero" / "conf").exists()
    assert (CONF_DIR, RECIPES_DIR) == (REPO / "conf", REPO / "recipes")
    assert main(["train", "--help"]) == 0
    offered = next(line for line in capfd.readouterr().out.splitlines() if line.startswith("recipe: "))
    assert offered == "recipe: " + ", ".join(sorted(p.stem for p in (REPO / "recipes").glob("*.yaml")))


@pytest.mark.parametrize(
    ("recipe", "strategy", "model"),
    [
        ("gpt_small_zero3", 3, "lightning_zero.models.GPTConfig"),
        ("hf_llama_finetune", 2, "lightning_zero.models.hf.HFModelConfig"),
        ("gpt_large_zero3", 3, "lightning_zero.models.GPTConfig"),
        ("gpt_medium_zero3_offload", 3, "lightning_zero.models.GPTConfig"),
        ("gpt_small_zero3_hybrid", 3, "lightning_zero.models.GPTConfig"),
        ("gpt_small_zero3_hpz", 3, "lightning_zero.models.GPTConfig"),
        ("gpt_small_zero3_qgz", 3, "lightning_zero.models.GPTConfig"),
    ],
)
def test_recipe_composes(recipe, strategy, model):
    from hydra import compose, initialize_config_dir

    from lightning_zero.cli import register_configs

    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"recipe={recipe}"])
    assert cfg.strategy.stage == strategy
    assert cfg.model.model_config._target_ == model


def _recipe_cases():
    needs_hf = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="optional extra `hf` (transformers) not installed")
    return [
        pytest.param("gpt_small_zero3", []),
        pytest.param("hf_llama_finetune", [], marks=needs_hf),
        # 85M parameters: tens of seconds per step on 2 CPU cores.
        pytest.param("gpt_large_zero3", ["seq_len=64", "data.batch_size=1"], marks=pytest.mark.slow),
    ]


@pytest.mark.parametrize(("recipe", "extra"), _recipe_cases())
def test_recipe_trains(tmp_path, capfd, recipe, extra):
    overrides = [o for o in TINY if not o.startswith(("model=", "seq_len=", "data.batch_size"))]
    rc = main(["train", f"recipe={recipe}", *overrides, *extra, "trainer.max_steps=2", "trainer.val_check_interval=2",
               "strategy.start_method=fork", f"hydra.run.dir={tmp_path}"])
    assert rc == 0, capfd.readouterr().err[-3000:]
    s = summary_of(tmp_path)
    assert s.steps == 2 and s.option is not None
    for measured, modelled in zip(s.held, s.predicted):
        assert modelled <= measured <= modelled * 1.05


def test_hf_recipe_without_transformers_fails_cleanly(tmp_path, capfd, monkeypatch):
    import importlib.util as util

    find_spec = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "transformers" else find_spec(name, *a))
    assert main(["train", "recipe=hf_llama_finetune", f"hydra.run.dir={tmp_path}"]) == 2
    err = capfd.readouterr().err.strip()
    assert err == (
        "lightning-zero train: error: model.model_config.model_type='llama' needs the optional dependency "
        "transformers: pip install 'lightning_zero[hf]'"
    )


# ----------------------------------------------------------------------------------------------------- bad input

BAD_INPUT = [
    ("strategy.stage=5", "strategy.stage=5 is invalid: allowed values are 1, 2 or 3"),
    ("strategy.bucket_mb=0", "strategy.bucket_mb=0 is invalid: it must be a number of MiB > 0"),
    ("strategy.bucket_mb=-1", "strategy.bucket_mb=-1 is invalid: it must be a number of MiB > 0"),
    ("trainer.precision=fp17", "trainer.precision='fp17' is invalid: allowed values are 32-true, bf16-mixed, 16-mixed"),
    ("trainer.precision=bf16-true", "trainer.precision='bf16-true' is invalid: allowed values are 32-true"),
    ("strategy=zero5", "strategy=zero5 is not an option: allowed values are auto, ddp, zero1, zero1_offload, zero2, "
     "zero2_offload, zero3, zero3_hpz, zero3_hybrid, zero3_offload, zero3_offload_disk"),
    ("model=gpt_huge", "model=gpt_huge is not an option: allowed values are gpt_large, gpt_small, gpt_tiny, hf_gpt2, "
     "hf_llama"),
    ("recipe=nope", "recipe=nope is not an option: allowed values are gpt_large_zero3, gpt_long_context_ac, "
     "gpt_medium_zero3_offload, gpt_small_zero3"),
    ("strategy.bucket_m=1", "strategy.bucket_m is not a field of strategy: allowed fields are stage, bucket_mb,"),
    ("trainer.max_stepz=1", "trainer.max_stepz is not a field of trainer: allowed fields are accelerator, devices,"),
    ("strateg=zero2", "strateg is not a config group or field: allowed fields are data, model, monitor, recipe,"),
    ("+strategy.foo=1", "strategy.foo is not a parameter of lightning_zero.ZeroStrategy: allowed fields are stage,"),
    ("model.model_config.n_head=3", "model.model_config.n_head=3 is invalid for d_model=128"),
    ("model.frozen=[nope]", "model.frozen='nope' matches no parameter: parameter names start with blocks, ln_f"),
    ("data.max_bytes=10", "data.max_bytes=10 is too small for seq_len=128 and val_fraction=0.05"),
    ("strategy=auto strategy.budget_gb=0.001", "strategy=auto: nothing fits: zero"),
    ("strategy.stage=[1", "cannot parse the overrides:"),
]


@pytest.mark.parametrize(("override", "message"), BAD_INPUT)
def test_bad_input_fails_with_one_line_before_any_launch(tmp_path, capfd, override, message):
    run_dir = tmp_path / "run"
    assert main(["train", *override.split(), f"hydra.run.dir={run_dir}"]) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith(f"lightning-zero train: error: {message}")
    assert len(err.splitlines()) == 1
    assert not run_dir.exists()  # failed before Hydra made the run directory, so before any rank started


def test_bad_trainer_argument_fails_with_one_line(tmp_path, capfd):
    assert main(["train", "trainer.devices=0", f"hydra.run.dir={tmp_path}"]) == 2
    err = capfd.readouterr().err.strip()
    assert err == (
        "lightning-zero train: error: trainer: `Trainer(devices=0)` value is not a valid input using cpu accelerator."
    )


def test_bad_input_from_the_real_command_has_no_traceback(tmp_path):
    result = run_command("train", "strategy.stage=5", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "lightning-zero train: error: strategy.stage=5 is invalid: allowed values are 1, 2 or 3"
    )
    assert not (tmp_path / "outputs").exists()


def test_train_help_lists_the_config_groups(capfd):
    assert main(["train", "--help"]) == 0
    out = capfd.readouterr().out
    assert (
        "strategy: auto, ddp, zero1, zero1_offload, zero2, zero2_offload, zero3, zero3_hpz, zero3_hybrid, zero3_offload, "
        "zero3_offload_disk"
    ) in out
    assert "recipe: gpt_large_zero3, gpt_long_context_ac, gpt_medium_zero3_offload, gpt_small_zero3, " in out


# ------------------------------------------------------------------------------------------------------ estimate


def test_estimate_table_and_recommendation(capfd):
    budget_gb = str(12000 / 2**30)
    assert main(["estimate", "--params", "1000", "--ranks", "4", "--bucket-mb", "0", "--budget-gb", budget_gb]) == 0
    out = capfd.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out if line.startswith(("ddp", "zero"))}
    # device column (bytes, shown with a unit; the 5th of 7 cells) and the fit column: 16000, 10000, 7000, 4000 bytes
    # against 12000.
    assert rows["ddp"][9:11] + rows["ddp"][-1:] == ["15.62", "KiB", "no"]
    assert rows["zero1"][9:11] + rows["zero1"][-1:] == ["9.77", "KiB", "yes"]
    assert rows["zero3"][9:11] + rows["zero3"][-1:] == ["3.91", "KiB", "yes"]
    assert len(rows) == 11  # ddp, zero1-3, and their offload options
    assert out[-2] == "recommendation: zero1: the least complex option that fits (9.77 KiB of 11.72 KiB per rank)"
    assert out[-1] == 'select it with: strategy=zero1 on the command line, Trainer(strategy="zero1") in Python'


def test_estimate_knows_the_offload_options(capfd):
    # 1000 parameters, 16-bit, 4 ranks, no bucket; a 999-byte device budget, 4000 bytes of host memory, 10 KiB of disk.
    kib = 2**-20
    args = ["--params", "1000", "--ranks", "4", "--precision", "bf16-mixed", "--bucket-mb", "0",
            "--budget-gb", str(999 * 2**-30), "--host-budget-gb", str(4000 * 2**-30), "--disk-budget-gb", str(10 * kib)]
    assert main(["estimate", *args]) == 0
    out = capfd.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in out if line.startswith(("ddp", "zero"))}
    # ZeRO-Offload stage 2: 2Ψ + 2Ψ/N = 2500 bytes on the device, 12Ψ/N = 3000 on the host plus 2 x 2Ψ/N of staging.
    assert rows["zero2_offload"] == ["1.95", "KiB", "500", "B", "2.93", "KiB", "0", "B",
                                     "2.44", "KiB", "3.91", "KiB", "0", "B", "no"]
    # Stage 3 with the parameter shards on the host too: only the gradient shards (2Ψ/N = 500 bytes) stay.
    assert rows["zero3_offload_params"][8:] == ["500", "B", "3.91", "KiB", "0", "B", "yes"]
    assert rows["zero3_offload_disk"][8:] == ["500", "B", "3.91", "KiB", "3.42", "KiB", "yes"]
    # No strategy is registered under that name: the recommendation says which settings it stands for.
    assert out[-1] == (
        "select it with: strategy=zero3 strategy.offload_optimizer=cpu strategy.offload_params=cpu on the command line, "
        "Trainer(strategy=ZeroStrategy(stage=3, offload_optimizer='cpu', offload_params='cpu')) in Python"
    )
    assert out[-2] == (
        "recommendation: zero3_offload_params: the least complex option that fits (500 B of 999 B on the device, "
        "3.91 KiB of 3.91 KiB of host memory per rank); nothing without offload fits (zero3 needs 3.91 KiB of 999 B on "
        "the device per rank)"
    )


def test_estimate_on_a_cpu_reads_the_budget_of_the_jobs_memory_cgroup(capfd, monkeypatch, tmp_path):
    # Inside a 3 GiB cgroup with 0.25 GiB in use, on a host with 20 GiB available: 1.375 GiB per rank, against which
    # only disk offload fits a 303M-parameter fp32 model; its sub-groups are sized from a quarter of it.
    from lightning_zero.cli import estimate as estimate_cli
    from lightning_zero.host_memory import HostMemory

    source = "cgroup v1 /sys/fs/cgroup/memory/job: limit 3.00 GiB less 0.25 GiB in use"
    monkeypatch.setattr(estimate_cli, "host_memory", lambda: HostMemory(int(2.75 * 2**30), source))
    monkeypatch.setattr(estimate_cli, "_on_cuda", lambda: False)
    assert main(["estimate", "--params", "303M", "--ranks", "2", "--offload-dir", str(tmp_path)]) == 0
    out = capfd.readouterr().out.splitlines()
    assert f"host budget: 2.75 GiB free ({source}), shared by 2 ranks" in out
    assert next(line for line in out if line.startswith("budget per rank:")).startswith(
        "budget per rank: 1.38 GiB of memory (the device is host memory)")
    # A host run: the master, two moments, parameter rows and gradient shards, 20 bytes a 4-byte master; 352 MiB
    # over 2 buffers of 5 bytes a byte of master: 35.2 MiB each.
    assert ("disk offload (zero3_offload_disk): 2 resident sub-groups of 35.2 MiB of masters (from 25% of a host "
            "budget of 1.38 GiB per rank)") in out
    assert out[-2].startswith("recommendation: zero3_offload_disk: the least complex option that fits")


def test_estimate_from_a_model_config(capfd):
    assert main(["estimate", "--model", "gpt_small", "--ranks", "2", "--budget-gb", "1"]) == 0
    out = capfd.readouterr().out
    assert out.startswith(f"model gpt_small ({GPTConfig().num_parameters:,} parameters), 2 ranks, precision 32-true")
    assert "recommendation: ddp:" in out


def test_estimate_between_nodes_gives_each_layouts_link_time_and_the_shortest_step(capfd):
    args = ["estimate", "--model", "gpt_small", "--ranks", "4", "--ranks-per-node", "2", "--budget-gb", "4",
            "--step-s", "1.3"]
    assert main([*args, "--link-gbps", "0.01"]) == 0
    out = capfd.readouterr().out
    assert "between 2 nodes of 2 ranks at 0.01 Gbit/s each way, 1.3 s of compute a step" in out
    assert "zero3     flat             5.05 MB     4.044     5.344" in out
    assert "between nodes among the options that fit the budget: zero3 zero++ makes the shortest step" in out
    assert main([*args, "--link-gbps", "1"]) == 0
    assert "between nodes among the options that fit the budget: ddp flat makes the shortest step" in capfd.readouterr().out
    assert main([*args[:-2], "--link-gbps", "1"]) == 2
    assert "--link-gbps needs the step's compute time: give --step-s, or --measure with --model" in capfd.readouterr().err
    assert main(["estimate", "--model", "gpt_small", "--ranks", "4", "--link-gbps", "1", "--step-s", "1"]) == 2
    assert "--link-gbps needs several nodes: give --ranks-per-node below --ranks=4" in capfd.readouterr().err


def test_estimate_with_hybrid_sharding_splits_the_communication(capfd):
    psi = GPTConfig().num_parameters
    assert main(["estimate", "--model", "gpt_small", "--ranks", "4", "--shard-group-size", "2"]) == 0
    out = capfd.readouterr().out
    assert out.startswith(f"model gpt_small ({psi:,} parameters), 2 ranks")  # the states of one group of 2
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("zero")}
    assert set(rows) == {"zero1", "zero2", "zero3", "zero1_offload", "zero2_offload", "zero3_offload",
                         "zero3_offload_params", "zero1_offload_disk", "zero2_offload_disk", "zero3_offload_disk"}
    # inside a group of 2: reduce-scatter + all-gather (zero1/2), and a second all-gather (zero3), half of it each;
    # across the 2 groups: the all-reduce of a rank's half of the gradients, half of it (a ring of 2)
    fmt = lambda n: " ".join(estimate.format_bytes(n).split())
    for option, inside in (("zero1", 2 * psi // 2), ("zero3", 3 * psi // 2), ("zero3_offload_disk", 3 * psi // 2)):
        line = " ".join(rows[option])
        assert line.endswith(f"{fmt(inside * 4)} {fmt(psi // 2 * 4)}"), (option, line)
    assert main(["estimate", "--model", "gpt_small", "--ranks", "4", "--shard-group-size", "3"]) == 2
    assert "--shard-group-size=3 is invalid for --ranks=4: it must divide the number of ranks" in capfd.readouterr().err
    # qwZ: zero3's gathers (forward and backward) as int8 codes and an fp32 scale per 4096 elements
    assert main(["estimate", "--model", "gpt_small", "--ranks", "4", "--shard-group-size", "2",
                 "--quantize-weights"]) == 0
    rows = {line.split(" (qwZ)")[0]: line.split()[2:4] for line in capfd.readouterr().out.splitlines()
            if " (qwZ) " in line}
    gather = psi + 4 * -(-psi // 4096)
    # offload moves the same bytes: every zero3 option's gathers are quantized, offloaded or not
    assert set(rows) == {"zero3", "zero3_offload", "zero3_offload_params", "zero3_offload_disk"}
    assert all(row == fmt((2 * gather + psi * 4) // 2).split() for row in rows.values()), rows
    # flat: one line for the whole run's bytes, with and without qwZ (with hpZ, the forward's gathers quantized only)
    for hpz, gathers in (([], 2), (["--hpz-group-size", "2"], 1)):
        assert main(["estimate", "--model", "gpt_small", "--ranks", "4", "--quantize-weights", *hpz]) == 0
        line = next(line for line in capfd.readouterr().out.splitlines() if line.startswith("qwZ"))
        backward = psi * 4 // 2 if hpz else 0  # hpZ's gather inside pairs, unquantized
        reduce = psi * 4  # the reduce-scatter over the 4 ranks, in full precision
        quantized, full = ((reduce + gathers * g) * 3 // 4 + backward for g in (gather, psi * 4))
        which = "every all-gather" if not hpz else "the forward's all-gathers"
        assert line == (f"qwZ (quantize_weights, zero3): with {which} as int8 blocks a rank moves "
                        f"{estimate.format_bytes(quantized)} per step instead of {estimate.format_bytes(full)} "
                        "(32-true, 4 ranks)"), line


def test_estimate_with_hpz_gives_the_secondary_shards_bytes(capfd):
    psi = GPTConfig().num_parameters
    assert main(["estimate", "--model", "gpt_small", "--ranks", "4", "--precision", "bf16-mixed",
                 "--hpz-group-size", "2"]) == 0
    line = next(line for line in capfd.readouterr().out.splitlines() if line.startswith("hpZ"))
    fmt = estimate.format_bytes
    assert line == (f"hpZ (hpz_group_size=2, zero3): the secondary shards add {fmt(psi)} per rank on the training "
                    f"device, offloaded or not, from a unit's forward to its backward (Psi * b / 2); the backward "
                    f"all-gather moves {fmt(psi)} per rank and "
                    f"step inside groups of 2 ranks (none across them) instead of {fmt(2 * psi * 3 // 4)} over the 4 "
                    "ranks that shard the model")
    assert main(["estimate", "--model", "gpt_small", "--ranks", "4", "--shard-group-size", "2",
                 "--hpz-group-size", "2"]) == 2
    assert "--hpz-group-size=2 is invalid for --shard-group-size=2: it must divide it and be smaller" in \
        capfd.readouterr().err


def test_estimate_counts_the_quantized_gradient_reduce(capfd):
    psi = GPTConfig().num_parameters
    assert main(["estimate", "--model", "gpt_small", "--ranks", "4", "--ranks-per-node", "2", "--quantize-grads",
                 "int4", "--budget-gb", "1"]) == 0
    line = next(line for line in capfd.readouterr().out.splitlines() if line.startswith("qgZ"))
    segment = -(-psi // 4)
    blocks = -(-segment // 4096)
    int4, int8 = -(-(-(-segment // 2) + 4 * blocks) // 4) * 4, -(-(segment + 4 * blocks) // 4) * 4
    fmt = estimate.format_bytes
    assert line == (f"qgZ (int4) over 2 node(s) of 2 ranks: the gradient reduce sends per rank and step "
                    f"{fmt(2 * int8)} inside its node (int8) and {fmt(int4)} across nodes (int4; "
                    f"{fmt(psi * 4 * 3 // 4)} in all unquantized, 32-true)")
    assert main(["estimate", "--params", "1B", "--ranks", "4", "--shard-group-size", "2", "--quantize-grads",
                 "int4"]) == 2
    assert "--quantize-grads with --shard-group-size: hybrid sharding refuses quantize_grads" in capfd.readouterr().err


def test_estimate_says_when_nothing_fits(capfd):
    args = ["--params", "70B", "--ranks", "8", "--precision", "bf16-mixed", "--budget-gb", "80", "--no-offload"]
    assert main(["estimate", *args]) == 0
    last = capfd.readouterr().out.splitlines()[-1]
    assert last == (
        "recommendation: nothing fits: zero3 needs 130.41 GiB per rank on 8 ranks, the budget is 80.00 GiB; "
        "zero3 fits on 14 ranks or more"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "7Q"], "params='7Q' is invalid: give a count like 350000, 125M, 1.3B or 7e9"),
        (["--params", "7B", "--ranks", "0"], "ranks=0 is invalid: it must be an integer >= 1"),
        (["--model", "nope"], "model=nope is not an option: allowed values are gpt_large, gpt_small, gpt_tiny"),
        (["--params", "7B", "--budget-gb", "0"], "--budget-gb=0.0 is invalid: it must be a number of GiB > 0"),
        (["--params", "7B", "--budget-gb", "1e-12"], "--budget-gb=1e-12 is invalid: it must be at least one byte"),
        (["--params", "7B", "--bucket-mb", "inf"], "bucket_mb=inf is invalid: it must be a finite number of MiB >= 0"),
    ],
)
def test_estimate_bad_input(capfd, args, message):
    assert main(["estimate", *args]) == 2
    assert capfd.readouterr().err.strip().startswith(f"lightning-zero estimate: error: {message}")


@pytest.mark.parametrize("value", ["inf", "nan", "-2", "0"])
def test_estimate_refuses_a_budget_that_is_not_a_finite_positive_number(capfd, value):
    assert main(["estimate", "--params", "7B", "--budget-gb", value]) == 2
    assert capfd.readouterr().err == (  # one line, no traceback
        f"lightning-zero estimate: error: --budget-gb={float(value)} is invalid: it must be a number of GiB > 0 and "
        "finite\n"
    )


def test_precisions_and_dtype_names_are_the_configs(capfd):
    # One list of supported precisions and one map of dtype names (lightning_zero.config), wherever the CLI asks.
    for command, names in (("estimate", config.PRECISIONS), ("consolidate", config.DTYPES)):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "{" + ",".join(names) + "}" in capfd.readouterr().out
    assert estimate.PRECISIONS == tuple(config.PRECISIONS) == ("32-true", "bf16-mixed", "16-mixed")
    assert [_check_precision(flag) for flag in ("bf16", "16", 32, "16-mixed")] == [
        "bf16-mixed", "16-mixed", "32-true", "16-mixed"
    ]
