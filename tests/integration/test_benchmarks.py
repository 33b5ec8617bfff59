"""benchmarks/compare.py: the --quick run works end to end and its figures are consistent (not that they are fast).

The quick run needs only this project's own dependencies: DeepSpeed rows are reported as skipped when it is not
installed, and the plot is skipped when matplotlib is not.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

from zbench import report  # noqa: E402
from zbench.measure import CollectiveCounter, ring_bytes  # noqa: E402
from zbench.model import SIZES, build_model  # noqa: E402
from zbench.plan import GOALS, full_plan, quick_plan, schedule  # noqa: E402

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_model_size_formula_and_tenfold_span() -> None:
    for size in SIZES.values():
        assert sum(p.numel() for p in build_model(size).parameters()) == size.n_params
    assert SIZES["L"].n_params >= 10 * SIZES["S"].n_params


def test_schedule_alternates_order_between_rounds() -> None:
    order = schedule(full_plan(rounds=2))
    main = [(n, r) for c, n, r in order if c.name == "M-2"]
    first = [n for n, r in main if r == 0]
    second = [n for n, r in main if r == 1]
    assert sorted(first) == sorted(second) and first != second
    # Configurations are interleaved: every configuration's first round comes before any second round.
    rounds = [r for _, _, r in order]
    assert rounds == sorted(rounds)


def test_goal_approaches_get_more_rounds() -> None:
    plan = full_plan(rounds=2)
    runs: dict[tuple[str, str], list[int]] = {}
    for c, n, r in schedule(plan):
        runs.setdefault((c.name, n), []).append(r)
    assert set(GOALS) < set(plan[0].approaches)
    for (config, name), rounds in runs.items():
        expected = 6 if config == "M-2" and name in GOALS else 3 if config == "M-2" else 2
        assert rounds == list(range(expected)), (config, name, rounds)


def test_ring_volume_convention() -> None:
    n = 1000
    # DDP's all-reduce of Psi bytes reads 2 units of (N-1)/N * Psi; a reduce-scatter plus an all-gather also 2.
    assert ring_bytes({"all_reduce": (1, n)}, 4) == pytest.approx(2 * n * 3 / 4)
    assert ring_bytes({"reduce_scatter": (1, n), "all_gather": (2, n)}, 2) == pytest.approx(n)
    assert ring_bytes({"all_reduce": (1, n)}, 1) == 0.0
    # A reduce-scatter sent point to point at 4 ranks: 3 sends of n/4 each, counted as sent.
    assert ring_bytes({"p2p": (3, 3 * n // 4)}, 4) == pytest.approx(3 * n / 4)
    assert CollectiveCounter.delta({"a": (3, 30), "b": (1, 5)}, {"a": (1, 10), "b": (1, 5)}) == {"a": (2, 20)}


def test_quick_run_is_consistent(tmp_path: Path) -> None:
    out = tmp_path / "BENCH.md"
    results_path = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "compare.py"), "--quick", "--out", str(out), "--results", str(results_path),
         "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(results_path.read_text())
    planned = {(c.name, a) for c in quick_plan() for a in c.approaches}

    # Every approach either ran on every rank or was skipped for a missing optional package, and said so.
    ran = {(r["config"], r["approach"]) for r in results["runs"]}
    assert all(r["ok"] for r in results["runs"]), [r.get("error") for r in results["runs"] if not r["ok"]]
    for config, name in planned - ran:
        assert name.startswith("ds_") and not HAVE_DEEPSPEED, (config, name)
        assert "deepspeed not installed" in results["skipped"][name]
    assert HAVE_DEEPSPEED or {n for _, n in planned if n.startswith("ds_")} <= set(results["skipped"])

    summary = report.summarize(results)
    two = summary["tiny-2"]
    psi = two["ddp"]["n_params"] * 4  # fp32 bytes
    for name, row in two.items():
        assert row["ok"], name
        # Timing figures are ordered and throughput follows from the median.
        assert 0 < row["step_min"] <= row["step_s"] <= row["step_max"]
        # CPU time is recorded per step and rank (all ranks summed in the figure), the host's steal per run.
        assert row["cpu_s"] > 0
        assert all(x is None or 0.0 <= x <= 1.0 for x in row["round_steal"]), row["round_steal"]
        assert row["tokens_per_s"] == pytest.approx(2 * 2 * SIZES["tiny"].seq / row["step_s"])
        # Training happened, and identically for every approach (float re-association only).
        assert row["losses"][-1] < row["losses"][0], name
        assert row["final_loss"] == pytest.approx(two["ddp"]["final_loss"], rel=report.LOSS_RTOL), name
        assert row["peak_rss"] > row["rss_base"] > 0
        assert row["model_state"] <= row["all_tensors"]

    # Communication, counted by wrapping torch.distributed: DDP all-reduces Psi once (2 units); lightning_zero's own
    # accounting moves (N-1)/N of (padded) Psi per reduce-scatter and per all-gather.
    assert two["ddp"]["comm_psi"] == pytest.approx(2.0, rel=1e-3)
    assert two["lit_ddp"]["comm_psi"] == pytest.approx(2.0, rel=1e-3)
    for stage in (1, 2, 3):
        own = two[f"lz_zero{stage}"]["own_comm"][0]
        assert psi / 2 <= own["reduce_scatter"] <= psi / 2 * 1.01
        gathers = 1 if stage < 3 else 2  # stage 3 gathers the blocks twice (forward, backward), the root once
        assert psi / 2 <= own["all_gather"] <= gathers * psi / 2 * 1.01

    # Model-state bytes counted from held tensors: fp32 AdamW is 16 bytes per parameter under DDP; the stages shard
    # 8 (zero1: Adam moments), 12 (zero2: + gradients) and 16 (zero3: + parameters) of them, up to padding.
    # (Plus AdamW's 4-byte step counter per parameter tensor.)
    assert 16 * psi / 4 <= two["ddp"]["model_state"] <= 16 * psi / 4 * 1.001
    for stage, sharded in ((1, 8), (2, 12), (3, 16)):
        row = two[f"lz_zero{stage}"]
        expected = (16 - sharded) * row["n_params"] + sharded * row["n_params"] / 2
        assert expected <= row["model_state"] <= expected * 1.01, stage
        assert row["own_model_state"]["total"] == row["model_state"]  # the strategy's own count agrees
    assert two["lz_zero3"]["model_state"] < two["lz_zero2"]["model_state"] < two["lz_zero1"]["model_state"]
    assert two["lz_zero1"]["model_state"] <= two["torch_zero1"]["model_state"]
    assert two["lz_zero3"]["model_state"] <= two["fsdp2"]["model_state"]

    # World size 1: lightning_zero trains exactly like a plain loop.
    one = summary["tiny-1"]
    assert one["lz_zero3"]["losses"] == pytest.approx(one["single"]["losses"], rel=1e-6)

    text = out.read_text()
    assert "--quick" in text and "| lightning_zero zero3 |" in text and "Acceptance criteria" in text
    assert "CPU per step, all ranks" in text
    for run in results["runs"]:
        for rank in run["ranks"]:
            assert len(rank["cpu"]) == len(rank["times"]) and all(c > 0 for c in rank["cpu"])
    if not HAVE_DEEPSPEED:
        assert "skipped: deepspeed not installed" in text
    plot = results_path.with_suffix(".png")
    assert plot.exists() == HAVE_MATPLOTLIB


def test_gpu_mode_runs_on_cpu_at_a_tiny_size(tmp_path: Path) -> None:
    """``compare.py --gpu`` (one process per approach, bf16-mixed) at the tiny size on the CPU: every approach ran,
    the table has a row per approach, and the figures follow from the step time (none is asserted to be fast)."""
    from zbench import gpu

    names = ["single", "zero1", "zero2", "zero3", "zero3_collectives"]
    results_path, table_path = tmp_path / "gpu.json", tmp_path / "GPU.md"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "compare.py"), "--gpu", "--gpu-size", "tiny", "--gpu-approaches", ",".join(names),
         "--results", str(results_path), "--out", str(table_path), "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {r["name"]: r for r in json.loads(results_path.read_text())["runs"]}
    assert sorted(runs) == sorted(names)
    size = gpu.SIZES["tiny"]
    for name, run in runs.items():
        assert "error" not in run, (name, run.get("error"))
        assert run["steps"] == size.steps and run["params"] == size.n_params
        assert 0 < run["step_ms_min"] <= run["step_ms"] <= run["step_ms_max"]
        assert run["tokens_per_s"] == pytest.approx(size.batch * size.seq / (run["step_ms"] / 1e3))
        assert run["tflops"] == pytest.approx(size.flops_per_step() / (run["step_ms"] / 1e3) / 1e12)
        assert math.isfinite(run["final_loss"]), name
    # lightning_zero at world size 1 takes one path whatever the stage, and issuing the collectives changes nothing.
    zero_losses = {runs[n]["final_loss"] for n in names if n.startswith("zero")}
    assert len(zero_losses) == 1, runs
    # The table: printed and written, a row per approach with its label, and the single device as the 1.000 row.
    for text in (proc.stdout, table_path.read_text()):
        assert "| approach | step ms median (min-max) | x single device | tokens/s | TFLOPS | MFU | peak GPU GiB |" in text
        for name in names:
            assert f"| {gpu.APPROACHES[name]} |" in text
        assert f"| {gpu.APPROACHES['single']} | " in text and " | 1.000 | " in text
        assert "size tiny, bf16-mixed, world size 1" in text
    assert sum(p.numel() for p in size.config.build().parameters()) == size.n_params  # the formula TFLOPS rely on


def _memory_results(zero3_steady: int) -> dict:
    """A results file of benchmarks/memory_phases.py with one lightning_zero job and one peer (bytes per phase)."""
    from zbench.memory_report import PHASES

    formula = {p: 1000 for p in PHASES}

    def job(steady: int) -> dict:
        phases = {p: dict(hwm=1000, anon=900, file=100) for p in PHASES}
        phases["steady_step"] = dict(hwm=steady, anon=steady - 100, file=100)
        return dict(ok=True, cgroup_peak=2 * steady, ranks=[dict(phases=phases, peak=steady)] * 2)

    return dict(command="python benchmarks/memory_phases.py", model_name="gpt_large", world=2, started="now",
                commit="abc", spec=dict(model=dict(n_layer=12, d_model=768, vocab_size=256, seq_len=128), batch=2,
                                        steps=3, build="eager", subgroup_mb=16.0),
                estimate=dict(params=85e6, measure=dict(baseline=1, activation_per_sample=2, activation_fixed=3,
                                                        unit_elements=4, root_unit_elements=5),
                              formulas={o: dict(phases=formula, peak=1000, terms={"baseline": 1}) for o in
                                        ("zero3", "ddp")}),
                jobs={"lz_zero3": job(zero3_steady), "lit_ddp": job(1500)})


def test_memory_report_lists_a_lightning_zero_phase_over_its_formula_as_a_finding() -> None:
    from zbench import memory_report

    over = memory_report.render(_memory_results(zero3_steady=1150))
    assert "zero3 steady_step: 0.00 GiB measured" in over and "(1.15x;" in over
    assert "| DDP (Lightning) |" in over and "DDP" not in over.split("Findings")[1]  # peers are measured, not judged
    within = memory_report.render(_memory_results(zero3_steady=1090))
    assert within.rstrip().endswith("over its formula): none.")


@pytest.mark.slow
def test_memory_phases_quick_run(tmp_path: Path) -> None:
    results_path = tmp_path / "memory.json"
    done = subprocess.run(
        [sys.executable, str(BENCH / "memory_phases.py"), "--quick", "--approaches", "lz_zero1,lz_zero3",
         "--workdir", str(tmp_path), "--results", str(results_path)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads(results_path.read_text())
    for name in ("lz_zero1", "lz_zero3"):
        job = results["jobs"][name]
        assert job["ok"] and len(job["ranks"]) == 2
        for rank in job["ranks"]:
            phases = rank["phases"]
            assert set(phases) == {"import_build", "setup", "first_step", "steady_step", "checkpoint_save", "teardown",
                                   "load_resume"}
            # Each phase's peak is at least the interpreter's baseline and at most the process's lifetime peak.
            assert all(rank["baseline"] <= p["hwm"] <= rank["peak"] for p in phases.values())
            assert all(p["anon"] + p["file"] >= 0.9 * p["hwm"] for p in phases.values())


@pytest.mark.slow
@pytest.mark.parametrize("what", ["compile", "average"])
def test_zero3_features_runs_every_approach_at_a_tiny_size(tmp_path: Path, what: str) -> None:
    """benchmarks/zero3_features.py (issue 39): every approach runs, learns the same losses as its counterpart, and
    the table has a row for each."""
    import zero3_features

    results_path = tmp_path / f"{what}.json"
    done = subprocess.run(
        [sys.executable, str(BENCH / "zero3_features.py"), what, "--size", "tiny", "--rounds", "1", "--steps", "2",
         "--workdir", str(tmp_path), "--results", str(results_path)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads(results_path.read_text())
    finals = {}
    for run in results["runs"]:
        assert run["ok"], run.get("error")
        finals[run["approach"]] = [d["losses"][-1] for d in sorted(run["ranks"], key=lambda d: d["rank"])]
    for changed, plain in zero3_features.PAIRS[what]:
        assert finals[changed] == pytest.approx(finals[plain], rel=1e-4), changed  # inductor: compile's tolerance
    table = "\n".join(zero3_features.TABLES[what](results))
    assert table.count("\n| ") == len({n for pair in zero3_features.PAIRS[what] for n in pair})  # a row each
