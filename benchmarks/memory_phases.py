#!/usr/bin/env python
"""Whole-run memory, phase by phase: every lightning_zero stage and offload mode beside DDP, FSDP2 and DeepSpeed.

Each approach runs as one 2-rank job of fresh processes (``zbench/phases.py``) that goes through every phase of a
user's job: import and build, strategy setup, first step, steady steps, checkpoint save, teardown, then load and
resume (see [Note: the phases of a job] there). Per rank and phase it records the peak resident memory (VmHWM, reset
at the phase's start) and its split into anonymous and file-mapped memory; per job, the whole job's peak with the page
cache (every rank, under one cgroup: ``memlimit``, when this machine has it and runs as root). Beside each figure
stands the memory model's formula for that phase (``lightning_zero.estimate.phase_formulas``: the model states of
the stage and placement, the eager model, the gathered units and buckets in flight, the optimizer step's workspace,
the activations measured by ``estimate.measure_step``), and ``lightning-zero estimate --measure``'s predicted peak
per rank. A lightning_zero phase more than 10% over its formula is listed as a finding.

    python benchmarks/memory_phases.py                          # the 85M GPT (gpt_large), fp32, 2 ranks (~15 min)
    DS_ACCELERATOR=cpu .venv-peers/bin/python benchmarks/memory_phases.py   # with the DeepSpeed rows
    python benchmarks/memory_phases.py --quick                  # tiny model, a few approaches (< 2 min; the test)
    python benchmarks/memory_phases.py --report-only benchmarks/results/memory_phases.json

Writes the report (Markdown, printed too) to ``--out`` and every figure to ``--results`` (JSON); BENCHMARKS.md shows
the last full run's tables (``compare.py --report-only benchmarks/results/full.json`` renders them from
``benchmarks/results/memory_phases.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

LIGHTNING_ZERO = ["lz_zero1", "lz_zero2", "lz_zero3", "lz_zero1_offload", "lz_zero2_offload", "lz_zero3_offload",
                  "lz_zero3_offload_disk"]
PEERS = ["lit_ddp", "fsdp2", "ds_z1", "ds_z2", "ds_z3"]
QUICK = ["lit_ddp", "fsdp2", "lz_zero1", "lz_zero3", "lz_zero3_offload_disk"]
#: The benchmark model: conf/model/gpt_large.yaml (so that ``lightning-zero estimate --model gpt_large`` sizes it).
MODEL = "gpt_large"
TINY = dict(vocab_size=256, n_layer=2, n_head=2, d_model=64, seq_len=32, dropout=0.0, tie_embeddings=True)
MEMLIMIT = os.path.join(os.path.dirname(ROOT), "shared", "tools", "memlimit")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, a few approaches (what the test runs)")
    ap.add_argument("--model", default=MODEL, help="a model config of conf/model (default: gpt_large, 85M)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    ap.add_argument("--steps", type=int, default=3, help="steps of the first run (one more after resuming)")
    ap.add_argument("--build", choices=("eager", "configure_model"), default="eager",
                    help="build the model in __init__ (every approach) or in configure_model (Lightning ones)")
    ap.add_argument("--subgroup-mb", type=float, default=16.0, help="offload_subgroup_mb of the disk offload job "
                    "(default 16: at the library's 256 a sub-group is larger than this model's shards)")
    ap.add_argument("--approaches", default="", help="comma list (default: every lightning_zero mode and peer)")
    ap.add_argument("--limit-gib", type=float, default=None, help="memlimit's limit per job (default: all memory)")
    ap.add_argument("--memlimit", default=MEMLIMIT, help="the memlimit tool (whole-job peak with page cache)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the ranks")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per job")
    ap.add_argument("--workdir", default=os.path.join(ROOT, "bench_work", "memory_phases"))
    ap.add_argument("--out", default=None, help="Markdown report (default: <workdir>/MEMORY.md)")
    ap.add_argument("--results", default=None, help="JSON figures (default: benchmarks/results/memory_phases.json, "
                                                    "or <workdir>/quick.json with --quick)")
    ap.add_argument("--report-only", default="", help="re-render the report from a JSON results file")
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        return run_ranks(json.loads(args.job), args.python)

    from zbench import memory_report

    if args.report_only:
        with open(args.report_only) as f:
            results = json.load(f)
        memory_report.write(results, args.out or os.path.join(args.workdir, "MEMORY.md"))
        return 0
    os.makedirs(args.workdir, exist_ok=True)
    names = [n for n in args.approaches.split(",") if n] or (QUICK if args.quick else LIGHTNING_ZERO + PEERS)
    model = TINY if args.quick else model_shape(args.model)
    spec = dict(model=model, batch=args.batch, steps=args.steps, build=args.build, threads=1, subgroup_mb=args.subgroup_mb,
                workdir=args.workdir, outdir=args.workdir)
    results = dict(command=" ".join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT)
                                     else "python", os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]),
                   model_name="tiny" if args.quick else args.model, spec=spec, world=2,
                   started=time.strftime("%Y-%m-%d %H:%M"), commit=git_commit(), jobs={})
    results["estimate"] = memory_report.predictions(spec, world=2, python=args.python)
    for name in names:
        job = run_job(name, spec, args)
        results["jobs"][name] = job
        print(f"[memory_phases] {name}: {'ok' if job['ok'] else 'FAILED ' + job.get('error', '')} "
              f"({job['wall_s']:.0f} s, whole job {_gib(job.get('cgroup_peak'))} GiB)", flush=True)
    results_path = args.results or (os.path.join(args.workdir, "quick.json") if args.quick
                                    else os.path.join(HERE, "results", "memory_phases.json"))
    os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)
    memory_report.write(results, args.out or os.path.join(args.workdir, "MEMORY.md"))
    return 1 if any(not j["ok"] and not j.get("skipped") for j in results["jobs"].values()) else 0


def model_shape(name: str) -> dict:
    """The GPT shape of a conf/model config, as ``lightning-zero estimate --model NAME`` composes it."""
    import dataclasses

    from lightning_zero.cli.compose import compose, instantiate

    config = instantiate("model", compose([f"model={name}"]).model).model_config
    return dataclasses.asdict(config)


def run_job(name: str, spec: dict, args) -> dict:
    """One approach's ranks as one job, under ``memlimit`` when it can be used (see the module docstring)."""
    from zbench.approaches import APPROACHES, missing_packages

    missing = missing_packages(APPROACHES[name])
    if missing:
        return dict(ok=False, skipped=True, error=f"{', '.join(missing)} not installed", wall_s=0.0)
    job = dict(spec, approach=name, world=2)
    for stale in (f"{name}{run}.rank{rank}.json" for run in ("", ".resume") for rank in range(2)):
        if os.path.exists(os.path.join(spec["outdir"], stale)):
            os.remove(os.path.join(spec["outdir"], stale))
    command = [args.python, os.path.abspath(__file__), "--python", args.python, "--job", json.dumps(job)]
    limited = _memlimit_usable(args.memlimit)
    if limited:
        command = [args.memlimit, str(args.limit_gib or total_gib()), *command]
    started = time.time()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
        code, stderr = done.returncode, done.stderr
    except subprocess.TimeoutExpired as err:
        code, stderr = "timeout", (err.stderr or b"").decode(errors="replace") if isinstance(err.stderr, bytes) \
            else (err.stderr or "")
    wall = time.time() - started
    peak = re.search(r"memlimit: peak ([0-9.]+) GiB", stderr or "")
    ranks = []
    for rank in range(2):
        paths = [os.path.join(spec["outdir"], f"{name}{run}.rank{rank}.json") for run in ("", ".resume")]
        if all(os.path.exists(p) for p in paths):
            with open(paths[0]) as f, open(paths[1]) as g:
                first, resumed = json.load(f), json.load(g)
            first["phases"].update(resumed["phases"])
            first["peak"] = max(first["peak"], resumed["peak"])
            ranks.append(first)
    result = dict(ok=code == 0 and len(ranks) == 2, code=code, wall_s=round(wall, 1), ranks=ranks,
                  cgroup_peak=int(float(peak.group(1)) * 2**30) if peak else None, limit_gib=args.limit_gib)
    if not result["ok"]:
        lines = [line for line in (stderr or "").splitlines() if line.strip()]
        result["error"] = " | ".join(lines[-6:])[-1200:]
    return result


def run_ranks(job: dict, python: str) -> int:
    """The job itself (inside memlimit's cgroup): its ranks as fresh processes, gloo on this host."""
    for resume in (False, True):
        code = _launch(dict(job, resume=resume), _free_port(), python)
        if code:
            return code
    return 0


def _free_port() -> int:
    """A port free now, asked afresh for each launch (the resume's too: the first launch's may still be closing)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(job: dict, port: int, python: str) -> int:
    procs = []
    name = job["approach"] + (".resume" if job["resume"] else "")
    for rank in range(job["world"]):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job["world"]),
                   LOCAL_WORLD_SIZE=str(job["world"]), NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
        if job["approach"].startswith("ds_"):
            env.setdefault("DS_ACCELERATOR", "cpu")
            env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, "bench_work", "torch_extensions"))
        log = open(os.path.join(job["outdir"], f"{name}.rank{rank}.log"), "w")
        procs.append((subprocess.Popen([python, "-m", "zbench.phases", json.dumps(job)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT, cwd=ROOT), log))
    codes = _wait_all([proc for proc, _ in procs])
    for _, log in procs:
        log.close()
    if any(codes):
        with open(os.path.join(job["outdir"], f"{name}.rank0.log")) as f:
            print("\n".join(f.read().splitlines()[-8:]), file=sys.stderr)
    return max(codes)


def _wait_all(procs: list[subprocess.Popen]) -> list[int]:
    """Every rank's exit code; once one fails, the others are ended (they would wait for it until their timeout)."""
    while any(proc.poll() is None for proc in procs):
        if any(proc.poll() not in (None, 0) for proc in procs):
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
        time.sleep(0.5)
    return [proc.returncode for proc in procs]


def _memlimit_usable(path: str) -> bool:
    return bool(path) and os.access(path, os.X_OK) and os.geteuid() == 0


def total_gib() -> float:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) / 2**20


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
