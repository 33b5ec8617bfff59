#!/usr/bin/env python
"""A model that does not fit, under a hard limit: a 303M-parameter fp32 GPT trained on 2 CPU ranks with
``zero3_offload_disk`` under one memory limit for the whole job, beside in-memory zero3 under the same limit and DDP
without one.

[Note: the runs of the memory-limit benchmark]
Each run is one 2-rank job launched as a user's script is (``python script.py``: Lightning's default launcher for
``strategy="ddp"`` and ZeroStrategy's ``start_method="popen"`` starts rank 1 by running the same command again;
rank 0 is the launching process), in a cgroup of its
own (tests/memlimit.py, what ``../shared/tools/memlimit`` does) that counts every process of the job and its page
cache, as a host with that much RAM would, and whose kernel kills the job when it cannot stay under the limit. A run
without a limit runs under the machine's whole memory, so that its whole-job peak is read the same way. The model is
GPTConfig(vocab_size=1024, n_layer=24, n_head=16, d_model=1024, seq_len=64), 302.8M parameters: in-memory ZeRO-3's
16Ψ/N of model states is 2.26 GiB a rank, 4.51 GiB for the job. It is built in ``configure_model`` (stage 3
materializes it unit by unit, straight into shards) or eagerly in ``__init__`` (each rank holds the full model,
1.13 GiB, until the strategy shards it). Every rank trains 4 sequences a step, 3 steps,
AdamW; disk offload streams sub-groups of 16 MiB through 2 resident buffers and keeps its files under ``--workdir``.

Recorded per run: whether the kernel killed it (the cgroup's ``oom_kill`` count) and its exit status, the whole job's
peak (the cgroup's), each rank's own peak (VmHWM), the losses of every step and rank, each step's time (the slower
rank's, from the batch's start to its end), and how far a killed run got. The report compares the losses with DDP's
and each limited run's step time with the same run without a limit (steps 2 and on: the first one also creates the
optimizer states).

    python benchmarks/memory_limit.py                       # every run, one after another (~30-45 min on 2 cores)
    python benchmarks/memory_limit.py --runs ddp,disk-cm-2.5
    python benchmarks/memory_limit.py --report-only benchmarks/results/memory_limit.json

Writes the figures to ``--results`` (default benchmarks/results/memory_limit.json) and prints the report; BENCHMARKS.md
renders the last run's (``compare.py --report-only benchmarks/results/full.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from memory_phases import git_commit, total_gib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "memory_limit.json")

MODEL = dict(vocab_size=1024, n_layer=24, n_head=16, d_model=1024, seq_len=64)
#: ``--quick``: the same runs on a tiny model (a check of the script, not a measurement).
TINY = dict(vocab_size=256, n_layer=2, n_head=2, d_model=64, seq_len=32)
BATCH = 4
STEPS = 3
SUBGROUP_MB = 16
RESIDENT_SUBGROUPS = 2
#: name: (strategy, build, limit in GiB or None for the machine's whole memory[, "loop"]), in the order they run;
#: "loop": AdamW(foreach=False), torch's single-tensor loop, which DDP runs on CPU tensors by default, where offload
#: otherwise steps with the fused CPU kernel (one ulp apart on a few elements: see HostOffload.use_fused_kernels).
RUNS = {
    "ddp": ("ddp", "eager", None),
    "disk-cm-2.5": ("zero3_offload_disk", "configure_model", 2.5),
    "disk-cm": ("zero3_offload_disk", "configure_model", None),
    "disk-eager-4.0": ("zero3_offload_disk", "eager", 4.0),
    "disk-eager": ("zero3_offload_disk", "eager", None),
    "disk-eager-4.0-loop": ("zero3_offload_disk", "eager", 4.0, "loop"),
    "zero3-cm-2.5": ("zero3", "configure_model", 2.5),
    "zero3-cm": ("zero3", "configure_model", None),
    "zero3-eager-4.0": ("zero3", "eager", 4.0),
    "zero3-eager": ("zero3", "eager", None),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="", help=f"comma list of {', '.join(RUNS)} (default: all)")
    ap.add_argument("--workdir", default=os.path.join(ROOT, "bench_work", "memory_limit"))
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--quick", action="store_true", help="a tiny model, to check the script (results in --workdir)")
    ap.add_argument("--report-only", default="", help="print the report of a results file")
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        return run_job(json.loads(args.job))
    if args.report_only:
        with open(args.report_only) as f:
            print(render(json.load(f)))
        return 0
    from tests.memlimit import available

    if available() is not None:
        print(f"memory_limit: no memory limit can be set here: {available()}", file=sys.stderr)
        return 2
    names = [n for n in args.runs.split(",") if n] or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"--runs: unknown {', '.join(unknown)}; known: {', '.join(RUNS)}")
    os.makedirs(args.workdir, exist_ok=True)
    if args.quick:
        args.results = os.path.join(args.workdir, "quick.json")
    model = TINY if args.quick else MODEL
    results = dict(command=" ".join(["python", os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]),
                   started=time.strftime("%Y-%m-%d %H:%M"), commit=git_commit(), model=model, batch=BATCH,
                   steps=STEPS, subgroup_mb=SUBGROUP_MB, resident_subgroups=RESIDENT_SUBGROUPS, runs={})
    if os.path.exists(args.results) and args.runs:  # a subset updates the runs it names
        with open(args.results) as f:
            results["runs"] = json.load(f).get("runs", {})
    for name in names:
        run = run_limited(name, model, args)
        results["runs"][name] = run
        print(f"[memory_limit] {name}: exit {run['code']}, whole job {_gib(run['job_peak'])} GiB, "
              f"{run['wall_s']:.0f} s", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
        with open(args.results, "w") as f:
            json.dump(results, f, indent=1)
    print(render(results))
    return 0


def run_limited(name: str, model: dict, args) -> dict:
    """One run in a cgroup of its own (tests/memlimit.py, what ``memlimit`` does), limited to the run's limit or to
    the machine's whole memory."""
    from tests.memlimit import run_limited as limited

    strategy, build, limit, *loop = RUNS[name]
    offload_dir = os.path.join(args.workdir, name)
    os.makedirs(offload_dir, exist_ok=True)
    job = dict(strategy=strategy, build=build, offload_dir=offload_dir, model=model, loop=bool(loop))
    command = [sys.executable, os.path.abspath(__file__), "--job", json.dumps(job)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PL_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    started = time.time()
    done = limited(int((limit or total_gib()) * 2**30), command, timeout_s=args.timeout, env=env)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    ranks = {r["rank"]: r for r in records if r.get("kind") == "rank"}
    progress = [r for r in records if r.get("kind") == "progress"]
    run = dict(strategy=strategy, build=build, limit_gib=limit, loop=bool(loop), code=done.returncode, oom_killed=done.oom_killed,
               wall_s=round(time.time() - started, 1), job_peak=done.peak_bytes,
               ranks=[ranks[r] for r in sorted(ranks)], reached=progress[-1]["where"] if progress else "start")
    if done.returncode != 0:
        run["error"] = " | ".join(line for line in done.stderr.splitlines()[-6:] if line.strip())[-800:]
    return run


# ----------------------------------------------------------------------------------------------------------------------
# the job (inside the limit)
# ----------------------------------------------------------------------------------------------------------------------
def run_job(job: dict) -> int:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy
    from lightning_zero.models import GPTConfig, LanguageModel

    config = GPTConfig(**job["model"])

    class EagerLanguageModel(LanguageModel):
        """The same network built in ``__init__``, in full, before the strategy sees it."""

        def __init__(self) -> None:
            super().__init__(config, lr=1e-4, warmup_steps=0)
            self.configure_model()

    class Record(pl.Callback):
        """Losses, step times and the rank's peak; a progress line at each point a killed run may have reached."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.step_s: list[float] = []
            self._started = 0.0

        def setup(self, trainer, pl_module, stage) -> None:
            _say(trainer, "setting up")

        def on_train_start(self, trainer, pl_module) -> None:
            _say(trainer, "set up")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.step_s.append(time.perf_counter() - self._started)
            self.losses.append(float(outputs["loss"]))
            _say(trainer, f"step {len(self.losses)}")

        def on_train_end(self, trainer, pl_module) -> None:
            print(json.dumps(dict(kind="rank", rank=trainer.global_rank, losses=self.losses, step_s=self.step_s,
                                  peak=_vmhwm())), flush=True)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = EagerLanguageModel() if job["build"] == "eager" else LanguageModel(config, lr=1e-4, warmup_steps=0)
    if job.get("loop"):
        configure = model.configure_optimizers

        def single_tensor_loop() -> dict:
            chosen = configure()
            for group in [chosen["optimizer"].defaults, *chosen["optimizer"].param_groups]:
                group["foreach"] = False
            return chosen

        model.configure_optimizers = single_tensor_loop
    tokens = torch.randint(0, config.vocab_size, (BATCH * 2 * STEPS, config.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    if job["strategy"] == "ddp":
        strategy = "ddp"
    else:
        options = dict(stage=3, start_method="popen", units=["Block"])
        if job["strategy"] == "zero3_offload_disk":
            options.update(offload_optimizer="disk", offload_params="disk", offload_dir=job["offload_dir"],
                           offload_subgroup_mb=SUBGROUP_MB, offload_resident_subgroups=RESIDENT_SUBGROUPS)
        strategy = ZeroStrategy(**options)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, callbacks=[Record()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train_dataloaders=data)
    return 0


def _say(trainer, where: str) -> None:
    if trainer.global_rank == 0:
        print(json.dumps(dict(kind="progress", where=where)), flush=True)


def _vmhwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


# ----------------------------------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------------------------------
def render(results: dict) -> str:
    """The table of BENCHMARKS.md's section: per run, the outcome, the whole job's peak, the losses against DDP's and
    the step time against the same run without a limit."""
    runs = results["runs"]
    reference = runs.get("ddp")
    ddp_losses = _losses(reference) if reference and reference["code"] == 0 else None
    unlimited = {(r["strategy"], r["build"]): r for r in runs.values()
                 if r["limit_gib"] is None and r["code"] == 0 and not r.get("loop")}
    m = results["model"]
    lines = [
        f"GPTConfig(vocab_size={m['vocab_size']}, n_layer={m['n_layer']}, n_head={m['n_head']}, "
        f"d_model={m['d_model']}, seq_len={m['seq_len']}), fp32, AdamW, 2 CPU ranks (each the script, started "
        f"by Lightning's popen launcher), {results['batch']} sequences a rank and step, {results['steps']} steps; "
        f"disk offload: sub-groups "
        f"of {results['subgroup_mb']} MiB, {results['resident_subgroups']} resident, files under bench_work/. Whole "
        f"job: every process of the job and its page cache (the cgroup's peak). Commit {results.get('commit')}, "
        f"{results['started']}. Command: `{results['command']}`.", "",
        "| strategy | model built | limit (GiB) | outcome | whole job peak (GiB) | rank peaks (GiB) | losses against "
        "DDP's | step time, steps 2-3 (s) | against no limit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        limit = "none" if run["limit_gib"] is None else f"{run['limit_gib']:g}"
        if run["code"] != 0:
            outcome = ("killed by the limit" if run["oom_killed"] else f"failed (exit {run['code']})") + \
                f", reached: {run['reached']}"
            lines.append(f"| {_label(run)} | {run['build']} | {limit} | {outcome} | "
                         f"{_gib(run['job_peak'])} | - | - | - | - |")
            continue
        ranks = ", ".join(_gib(r["peak"]) for r in run["ranks"])
        step = _steady_step(run)
        base = unlimited.get((run["strategy"], run["build"]))
        against = "-" if run["limit_gib"] is None or base is None else f"{step / _steady_step(base):.2f}x"
        lines.append(f"| {_label(run)} | {run['build']} | {limit} | trained | {_gib(run['job_peak'])} | {ranks} | "
                     f"{_compare_losses(_losses(run), ddp_losses, name == 'ddp')} | {step:.1f} | {against} |")
    return "\n".join(lines) + "\n"


def _label(run: dict) -> str:
    return run["strategy"] + (", AdamW(foreach=False)" if run.get("loop") else "")


def _losses(run: dict) -> list[list[float]]:
    return [r["losses"] for r in run["ranks"]]


def _steady_step(run: dict) -> float:
    """The mean of steps 2 and on, each the slower rank's."""
    per_step = [max(times) for times in zip(*(r["step_s"] for r in run["ranks"]))][1:]
    return sum(per_step) / len(per_step)


def _compare_losses(losses, reference, is_reference: bool) -> str:
    if is_reference:
        return "the reference: " + "; ".join(", ".join(f"{v:.6f}" for v in rank) for rank in losses)
    if reference is None:
        return "no DDP run"
    if losses == reference:
        return "bitwise equal, every step and rank"
    pairs = [(a, b) for mine, theirs in zip(losses, reference) for a, b in zip(mine, theirs)]
    equal = sum(a == b for a, b in pairs)
    worst = max(abs(a - b) for a, b in pairs)
    return f"{equal} of {len(pairs)} (step, rank) bitwise equal, the others within {worst:.2e}"


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


if __name__ == "__main__":
    sys.path.insert(0, ROOT)  # tests.memlimit
    sys.exit(main())
