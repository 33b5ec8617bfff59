#!/usr/bin/env python
"""A model that does not fit, under a hard limit: a 303M-parameter fp32 GPT, the project's own and a Hugging Face
GPT-2 built from its config, trained on 2 CPU ranks with ``zero3_offload_disk`` under one memory limit for the whole
job, beside in-memory zero3 under the same limit and without one, DDP without one, and ``strategy=auto``'s choice.

[Note: the runs of the memory-limit benchmark]
Each run is one 2-rank job launched as a user's script is (``python script.py``: Lightning's default launcher for
``strategy="ddp"`` and ZeroStrategy's ``start_method="popen"`` starts rank 1 by running the same command again;
rank 0 is the launching process, and every rank imports what the script imports, ``transformers`` included), in a
cgroup of its own (tests/memlimit.py, what ``../shared/tools/memlimit`` does) that counts every process of the job
and its page cache, as a host with that much RAM would, and whose kernel kills the job when it cannot stay under the
limit. A run without a limit runs under the machine's whole memory, so that its whole-job peak is read the same way.
The models: the project's GPTConfig(vocab_size=1024, n_layer=24, n_head=16, d_model=1024, seq_len=64), 302.8M
parameters, and ``transformers``' GPT-2 from ``GPT2Config(vocab_size=1024, n_layer=24, n_head=16, n_embd=1024,
n_positions=64)`` (tied embedding, dropout off), 303.4M, through ``LanguageModel(HFModelConfig("gpt2", ...))`` as
``conf/model/hf_gpt2.yaml`` builds it: in-memory ZeRO-3's 16Ψ/N of model states is 2.26 GiB a rank, 4.51 GiB for the
job. Each is built in ``configure_model`` (stage 3 materializes it unit by unit, straight into shards) or eagerly in
``__init__`` (each rank holds the full model, 1.13 GiB, until the strategy shards it). Every rank trains 4 sequences
a step, 3 steps, AdamW. Options: ``defaults`` (the strategy by its registered name, nothing else given: disk offload
sizes its sub-groups from the host budget, its files in the temporary directory, here under ``--workdir``),
``tuned`` (16 MiB sub-groups, 2 resident, as tuned by hand in issue 27), ``before`` (256 MiB, 3 resident: the
defaults before issue 38, whatever the host), ``loop`` (tuned, and
``AdamW(foreach=False)``), ``auto`` (``strategy=auto``: ``auto.choose`` in the launching process against the host
budget, ``auto.build``, the choice handed to rank 1 in the environment, as ``lightning-zero train strategy=auto``
does).

Recorded per run: whether the kernel killed it (the cgroup's ``oom_kill`` count) and its exit status, the whole job's
peak (the cgroup's), each rank's own peak (VmHWM), the losses of every step and rank, each step's time (the slower
rank's, from the batch's start to its end), how far a killed run got, the commit it ran at, and rank 0's run report
lines on the host budget and disk offload's sub-groups (and auto's choice and reason). The report compares the
losses with DDP's of the same model and each limited run's step time with the same run without a limit (steps 2 and
on: the first one also creates the optimizer states).

    python benchmarks/memory_limit.py                       # every run, one after another (~80 min on 2 cores)
    python benchmarks/memory_limit.py --runs gpt2-ddp,gpt2-disk-cm-2.5
    python benchmarks/memory_limit.py --report-only benchmarks/results/memory_limit.json

Writes the figures to ``--results`` (default benchmarks/results/memory_limit.json; a subset of runs updates those it
names) and prints the report; BENCHMARKS.md renders the last run's (``compare.py --report-only
benchmarks/results/full.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from memory_phases import git_commit, total_gib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "memory_limit.json")

MODELS = {
    "gpt": dict(vocab_size=1024, n_layer=24, n_head=16, d_model=1024, seq_len=64),
    "gpt2": dict(vocab_size=1024, n_layer=24, n_head=16, n_embd=1024, n_positions=64),
}
#: ``--quick``: the same runs on tiny models (a check of the script, not a measurement).
TINY = {
    "gpt": dict(vocab_size=256, n_layer=2, n_head=2, d_model=64, seq_len=32),
    "gpt2": dict(vocab_size=256, n_layer=2, n_head=2, n_embd=64, n_positions=32),
}
BATCH = 4
STEPS = 3
TUNED = dict(offload_subgroup_mb=16, offload_resident_subgroups=2)
#: The defaults of disk offload's sizes before issue 38, whatever the host.
BEFORE = dict(offload_subgroup_mb=256, offload_resident_subgroups=3)
#: name: (model, strategy, build, limit in GiB or None for the machine's whole memory, options), in the order they
#: run (see [Note: the runs of the memory-limit benchmark] for the options).
RUNS = {
    "ddp": ("gpt", "ddp", "eager", None, "defaults"),
    "disk-cm-2.5": ("gpt", "zero3_offload_disk", "configure_model", 2.5, "tuned"),
    "disk-cm": ("gpt", "zero3_offload_disk", "configure_model", None, "tuned"),
    "disk-eager-4.0": ("gpt", "zero3_offload_disk", "eager", 4.0, "tuned"),
    "disk-eager": ("gpt", "zero3_offload_disk", "eager", None, "tuned"),
    "disk-eager-4.0-loop": ("gpt", "zero3_offload_disk", "eager", 4.0, "loop"),
    "zero3-cm-2.5": ("gpt", "zero3", "configure_model", 2.5, "defaults"),
    "zero3-cm": ("gpt", "zero3", "configure_model", None, "defaults"),
    "zero3-eager-4.0": ("gpt", "zero3", "eager", 4.0, "defaults"),
    "zero3-eager": ("gpt", "zero3", "eager", None, "defaults"),
    "gpt2-ddp": ("gpt2", "ddp", "eager", None, "defaults"),
    "gpt2-disk-cm-2.5": ("gpt2", "zero3_offload_disk", "configure_model", 2.5, "defaults"),
    "gpt2-disk-cm-2.5-tuned": ("gpt2", "zero3_offload_disk", "configure_model", 2.5, "tuned"),
    "gpt2-disk-cm-2.5-before": ("gpt2", "zero3_offload_disk", "configure_model", 2.5, "before"),
    "gpt2-disk-eager-4.0": ("gpt2", "zero3_offload_disk", "eager", 4.0, "defaults"),
    "gpt2-zero3-cm": ("gpt2", "zero3", "configure_model", None, "defaults"),
    "gpt2-zero3-cm-2.5": ("gpt2", "zero3", "configure_model", 2.5, "defaults"),
    "gpt2-auto-cm-3.0": ("gpt2", "auto", "configure_model", 3.0, "auto"),
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
    models = TINY if args.quick else MODELS
    results = dict(command=" ".join(["python", os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]),
                   started=time.strftime("%Y-%m-%d %H:%M"), commit=git_commit(), models=models, batch=BATCH,
                   steps=STEPS, runs={})
    if os.path.exists(args.results) and args.runs:  # a subset updates the runs it names
        with open(args.results) as f:
            results["runs"] = json.load(f).get("runs", {})
    for name in names:
        run = run_limited(name, models[RUNS[name][0]], args)
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

    model_name, strategy, build, limit, options = RUNS[name]
    offload_dir = os.path.join(args.workdir, name)
    os.makedirs(offload_dir, exist_ok=True)
    job = dict(model_name=model_name, strategy=strategy, build=build, offload_dir=offload_dir, model=model,
               options=options)
    command = [sys.executable, os.path.abspath(__file__), "--job", json.dumps(job)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PL_")}
    # defaults: the offload files go where a user's would, the temporary directory (here under --workdir)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore", TMPDIR=offload_dir)
    started = time.time()
    done = limited(int((limit or total_gib()) * 2**30), command, timeout_s=args.timeout, env=env)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    ranks = {r["rank"]: r for r in records if r.get("kind") == "rank"}
    progress = [r for r in records if r.get("kind") == "progress"]
    report = next((r for r in records if r.get("kind") == "report"), {})
    run = dict(model=model_name, strategy=strategy, build=build, limit_gib=limit, options=options,
               code=done.returncode, oom_killed=done.oom_killed, wall_s=round(time.time() - started, 1),
               job_peak=done.peak_bytes, ranks=[ranks[r] for r in sorted(ranks)],
               reached=progress[-1]["where"] if progress else "start", commit=git_commit(),
               report=report.get("lines", []))
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

    from lightning_zero import ZeroStrategy, auto
    from lightning_zero.models import LanguageModel
    from lightning_zero.monitor import ZeroMonitor

    config = _model_config(job["model_name"], job["model"])

    class EagerLanguageModel(LanguageModel):
        """The same network built in ``__init__``, in full, before the strategy sees it."""

        def __init__(self) -> None:
            super().__init__(config, lr=1e-4, warmup_steps=0)
            self.configure_model()

    class Record(pl.Callback):
        """Losses, step times and the rank's peak; a progress line at each point a killed run may have reached."""

        reads_parameters = False

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
    if job["options"] == "loop":
        configure = model.configure_optimizers

        def single_tensor_loop() -> dict:
            chosen = configure()
            for group in [chosen["optimizer"].defaults, *chosen["optimizer"].param_groups]:
                group["foreach"] = False
            return chosen

        model.configure_optimizers = single_tensor_loop
    tokens = torch.randint(0, job["model"]["vocab_size"], (BATCH * 2 * STEPS, _seq(job["model"]) + 1),
                           generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    choice = None
    if job["strategy"] == "auto":
        settings = auto.AutoStrategy(offload_dir=job["offload_dir"])
        choice = auto.choose(settings, model.parameter_counts(), "32-true", accelerator="cpu", devices=2)
        strategy = auto.build(choice.option, settings)
    elif job["model_name"] == "gpt" and job["strategy"] != "ddp":  # the runs of issue 27, as they ran
        options = dict(stage=3, start_method="popen", units=["Block"])
        if job["strategy"] == "zero3_offload_disk":
            options.update(offload_optimizer="disk", offload_params="disk", offload_dir=job["offload_dir"])
            options.update(TUNED if job["options"] in ("tuned", "loop") else {})
        strategy = ZeroStrategy(**options)
    elif job["options"] in ("tuned", "before"):
        sizes = TUNED if job["options"] == "tuned" else BEFORE
        strategy = ZeroStrategy(stage=3, offload_optimizer="disk", offload_params="disk", **sizes)
    else:
        strategy = job["strategy"]  # by its registered name, nothing else given
    monitor = ZeroMonitor()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS,
                         callbacks=[Record(), monitor], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with auto.shared_with_ranks(choice):
        trainer.fit(model, train_dataloaders=data)
    if trainer.global_rank == 0:
        lines = [line.strip() for line in monitor.report().splitlines()
                 if "host budget" in line or "disk offload:" in line]
        if choice is not None and choice.reason is not None:
            lines.insert(0, f"strategy=auto chose {choice.reason}")
        print(json.dumps(dict(kind="report", lines=lines)), flush=True)
    return 0


def _seq(fields: dict) -> int:
    return fields.get("seq_len", fields.get("n_positions"))


def _model_config(name: str, fields: dict):
    """The project's GPT, or ``transformers``' GPT-2 built from its config as conf/model/hf_gpt2.yaml builds it."""
    from lightning_zero.models import GPTConfig

    if name == "gpt":
        return GPTConfig(**fields)
    import transformers  # noqa: F401  (a user's script imports it in every rank)

    from lightning_zero.models.hf import HFModelConfig

    return HFModelConfig("gpt2", dict(fields, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


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
    """The table of BENCHMARKS.md's section: per run, the outcome, the whole job's peak, the losses against DDP's of
    the same model, the step time against the same run without a limit, and the run report's lines on the host
    budget and disk offload's sub-groups."""
    runs = results["runs"]
    references = _references(runs)
    unlimited = {_kind(r): r for r in runs.values() if r["limit_gib"] is None and r["code"] == 0}
    models = results["models"]
    gpt, gpt2 = models["gpt"], models["gpt2"]
    lines = [
        f"Models: `gpt`, the project's GPTConfig({_fields(gpt)}); `gpt2`, transformers' GPT-2 from "
        f"GPT2Config({_fields(gpt2)}, dropout off); fp32, AdamW, 2 CPU ranks (each the script, started by "
        f"Lightning's popen launcher, importing what it imports), {results['batch']} sequences a rank and step, "
        f"{results['steps']} steps. Options: defaults (the strategy by its registered name, nothing else given), "
        f"tuned (disk offload: sub-groups of {TUNED['offload_subgroup_mb']} MiB, "
        f"{TUNED['offload_resident_subgroups']} resident), before (the defaults before issue 38: "
        f"{BEFORE['offload_subgroup_mb']} MiB, {BEFORE['offload_resident_subgroups']} resident), loop (tuned, "
        "AdamW(foreach=False)), auto "
        "(`strategy=auto`'s choice). Whole job: every process of the job and its page cache (the cgroup's peak). "
        f"Last command: `{results['command']}`, {results['started']}.", "",
        "| model | strategy | options | model built | limit (GiB) | outcome | whole job peak (GiB) | rank peaks (GiB) | "
        "losses against the reference | step time, steps 2-3 (s) | against no limit | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        limit = "none" if run["limit_gib"] is None else f"{run['limit_gib']:g}"
        head = f"| {run['model']} | {run['strategy']} | {run['options']} | {run['build']} | {limit} |"
        if run["code"] != 0:
            outcome = ("killed by the limit" if run["oom_killed"] else f"failed (exit {run['code']})") + \
                f", reached: {run['reached']}"
            lines.append(f"{head} {outcome} | {_gib(run['job_peak'])} | - | - | - | - | {run['commit']} |")
            continue
        ranks = ", ".join(_gib(r["peak"]) for r in run["ranks"])
        step = _steady_step(run)
        base = unlimited.get(_kind(run))
        against = "-" if run["limit_gib"] is None or base is None else f"{step / _steady_step(base):.2f}x"
        source, reference = references.get((run["model"], run["build"]), (None, None))
        losses = _compare_losses(_losses(run), reference, name == source)
        lines.append(f"{head} trained | {_gib(run['job_peak'])} | {ranks} | {losses} | {step:.1f} | {against} | "
                     f"{run['commit']} |")
    reports = [(name, run["report"]) for name, run in runs.items() if run.get("report")]
    if reports:
        lines += ["", "What rank 0's run report (ZeroMonitor) said:", ""]
        lines += [f"- {name}: " + "; ".join(report) for name, report in reports]
    return "\n".join(lines) + "\n"


def _references(runs: dict) -> dict[tuple[str, str], tuple[str, list[list[float]]]]:
    """The run each run's losses are compared with, and its losses, by (model, build): DDP's (an eager build); for a
    build in ``configure_model`` DDP's too where in-memory zero3's equal them, else in-memory zero3's without a limit
    (stage 3 materializes the model from the meta device, replaying each module's own initialization: the project's
    GPT gets DDP's weights, transformers' GPT-2, which ``post_init`` initializes, others)."""
    unlimited = {(r["model"], r["strategy"], r["build"]): (name, _losses(r)) for name, r in runs.items()
                 if r["code"] == 0 and r["limit_gib"] is None and r["options"] == "defaults"}
    references = {}
    for (model, strategy, build), found in unlimited.items():
        if strategy == "ddp":
            references[model, "eager"] = found
            zero3 = unlimited.get((model, "zero3", "configure_model"))
            references[model, "configure_model"] = found if zero3 is None or zero3[1] == found[1] else zero3
    return references


def _kind(run: dict) -> tuple:
    """Runs that differ only in their limit."""
    return run["model"], run["strategy"], run["build"], run["options"]


def _fields(fields: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in fields.items())


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
        return "no reference run"
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
