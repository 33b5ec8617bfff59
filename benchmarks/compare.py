#!/usr/bin/env python
"""lightning_zero against DDP, torch's ZeroRedundancyOptimizer, FSDP2 and DeepSpeed ZeRO, side by side.

Every approach trains the same GPT (benchmarks/zbench/model.py) on the same synthetic batches with the same AdamW,
for the same number of steps, each run in fresh processes (one per rank, gloo, one thread each), with runs of all
approaches alternating round by round so that machine drift hits all alike (zbench/plan.py). Per approach it reports
the median step time after warm-up (min/max), throughput, per-rank model-state bytes counted from held tensors, peak
RSS per rank, bytes communicated per step (counted by wrapping torch.distributed, the same for all) and the loss after
the last step, which must agree across approaches. It writes docs/benchmarks/comparison.md (tables), a PNG plot and
a JSON file with every raw figure.

    DS_ACCELERATOR=cpu .venv-peers/bin/python benchmarks/compare.py   # full run (~22-27 min on 2 cores)
    python benchmarks/compare.py --quick              # < 1 min, tiny model; report in bench_work/compare/quick/
    python benchmarks/compare.py --report-only benchmarks/results/full.json   # re-render the report and plot
    python benchmarks/compare.py --only M-2 --approaches ddp,lz_zero2 --rounds 1   # a subset
    python benchmarks/compare.py --gpu                # one GPU: 1.3B GPT, bf16-mixed, every approach (zbench/gpu.py)
    python benchmarks/compare.py --gpu --gpu-size tiny --gpu-approaches single,zero3   # the same on CPU, tiny

DeepSpeed rows need the ``deepspeed`` package and the plot needs matplotlib (benchmarks/README.md sets up an
environment with both); without them the DeepSpeed rows are reported as skipped and the plot is skipped, saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: Where a full run's report goes: the docs site's comparison page (BENCHMARKS.md keeps the headline ratios).
REPORT = os.path.join(ROOT, "docs", "benchmarks", "comparison.md")
sys.path.insert(0, HERE)

from zbench.approaches import APPROACHES, missing_packages  # noqa: E402
from zbench.plan import full_plan, quick_plan, schedule  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(config, name: str, rnd: int, args, outdir: str) -> dict:
    """Launch ``config.world`` fresh worker processes for one approach; collect their JSON records."""
    world = config.world
    run_id = f"{config.name}.{name}.r{rnd}"
    logdir = os.path.join(outdir, "logs")
    os.makedirs(logdir, exist_ok=True)
    spec = dict(approach=name, size=config.size.as_dict(), batch=config.batch, warmup=config.warmup,
                steps=config.steps, threads=args.threads, outdir=outdir, run_id=run_id,
                profile=name in args.torch_profile.split(","),
                timers=[t for t in args.timers.split(",") if t])
    port = _free_port()
    load_before = _loadavg()
    steal_before = _cpu_times()
    procs = []
    t0 = time.time()
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
            NODE_RANK="0", GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
            PYTHONPATH=HERE + os.pathsep + env.get("PYTHONPATH", ""),
        )
        if name.startswith("ds_"):
            env.setdefault("DS_ACCELERATOR", "cpu")
            env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, "bench_work", "torch_extensions"))
        cmd = [args.python, "-m", "zbench.worker", json.dumps(spec)]
        if args.pyspy and name in args.pyspy.split(","):
            cmd = [args.pyspy_bin, "record", "-r", str(args.pyspy_rate), "-f", "raw", "-o",
                   os.path.join(outdir, f"{run_id}.rank{rank}.pyspy.txt"), "--"] + cmd
        log = open(os.path.join(logdir, f"{run_id}.rank{rank}.log"), "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
    codes = []
    for proc, _ in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, args.timeout - (time.time() - t0))))
        except subprocess.TimeoutExpired:
            codes.append("timeout")
    for proc, log in procs:
        if proc.poll() is None:
            proc.kill()  # only the workers this driver started
            proc.wait()
        log.close()
    wall = time.time() - t0
    ranks = []
    for rank in range(world):
        path = os.path.join(outdir, f"{run_id}.rank{rank}.json")
        if os.path.exists(path) and os.path.getmtime(path) >= t0:
            with open(path) as f:
                ranks.append(json.load(f))
    base = dict(config=config.name, approach=name, round=rnd, wall_s=round(wall, 1), codes=codes,
                load_before=load_before, load_after=_loadavg(), steal=_steal_share(steal_before, _cpu_times()))
    if len(ranks) != world:
        with open(os.path.join(logdir, f"{run_id}.rank0.log")) as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
        return dict(base, ok=False, error=" | ".join(lines[-4:])[-800:])
    return dict(base, ok=True, ranks=ranks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, one round, a few approaches (< 2 min)")
    ap.add_argument("--out", default=None, help="markdown report to write (default: docs/benchmarks/comparison.md; "
                                                "with --quick, BENCHMARKS.md in the work directory)")
    ap.add_argument("--plot", default=None, help="PNG path (default: next to the JSON results)")
    ap.add_argument("--results", default=None, help="JSON results path (default: benchmarks/results/full.json, "
                                                    "or <workdir>/quick.json with --quick)")
    ap.add_argument("--workdir", default=os.path.join(ROOT, "bench_work", "compare"), help="logs and per-rank records")
    ap.add_argument("--goal-rounds", type=int, default=None,
                    help="more rounds of the main configuration's goal approaches (default: as many as its rounds)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of the scaling configurations (main: one more, and as many again of the approaches "
                    "its goal figures compare, zbench/plan.py)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per run (memory is counted in the last one)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run")
    ap.add_argument("--only", default="", help="comma list of configuration names to run (e.g. M-2,M-1)")
    ap.add_argument("--approaches", default="", help="comma list of approaches to keep")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the workers")
    ap.add_argument("--pyspy", default="", help="comma list of approaches to record with py-spy (raw stacks)")
    ap.add_argument("--pyspy-bin", default="py-spy")
    ap.add_argument("--pyspy-rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--torch-profile", default="", help="comma list of approaches to run under torch.profiler "
                                                        "(timed steps; table and Chrome trace per rank)")
    ap.add_argument("--timers", default="", help="comma list of module:Qual.name functions to time per step "
                                                 "(profiling; see zbench/measure.py PhaseTimers)")
    ap.add_argument("--gpu", action="store_true", help="the one-GPU comparison instead (zbench/gpu.py): one process "
                                                       "per approach, bf16-mixed, step time, tokens/s, TFLOPS, MFU, "
                                                       "peak GPU memory")
    ap.add_argument("--gpu-size", default="1.3B", help="model size of --gpu: 1.3B (default) or tiny (runs on CPU)")
    ap.add_argument("--gpu-profile", default="", help="with --gpu: a folder for each approach's torch.profiler "
                    "tables of 2 more steps after the timed ones")
    ap.add_argument("--gpu-approaches", default="", help="comma list of --gpu approaches (default: all)")
    ap.add_argument("--gpu-peak-tflops", type=float, default=None, help="peak TFLOPS MFU is measured against "
                                                                         "(default: 989, an H200's dense bf16)")
    ap.add_argument("--report-only", default="", help="re-render the report from a JSON results file")
    ap.add_argument("--command", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    from zbench import report

    if args.report_only:
        with open(args.report_only) as f:
            results = json.load(f)
        args.out = args.out or REPORT
        report.write(results, args.out, args.plot or os.path.splitext(args.report_only)[0] + ".png")
        return 0

    if args.gpu:
        return run_gpu(args, argv)
    if args.quick:
        configs = quick_plan()
    else:
        configs = full_plan(args.rounds, args.warmup, args.steps, args.goal_rounds)
    if args.only:
        keep = set(args.only.split(","))
        configs = [c for c in configs if c.name in keep]
    if args.approaches:
        keep = set(args.approaches.split(","))
        configs = [replace(c, approaches=tuple(a for a in c.approaches if a in keep)) for c in configs]
        configs = [c for c in configs if c.approaches]
    outdir = os.path.join(args.workdir, "quick" if args.quick else "full")
    os.makedirs(outdir, exist_ok=True)
    if args.out is None:
        args.out = os.path.join(outdir, "BENCHMARKS.md") if args.quick else REPORT
    results_path = args.results or (os.path.join(outdir, "quick.json") if args.quick
                                    else os.path.join(HERE, "results", "full.json"))
    plot_path = args.plot or os.path.splitext(results_path)[0] + ".png"

    skipped = {}
    for c in configs:
        for name in c.approaches:
            missing = missing_packages(APPROACHES[name])
            if missing:
                skipped[name] = f"{', '.join(missing)} not installed"
    order = [(c, n, r) for c, n, r in schedule(configs) if n not in skipped]
    print(f"[compare] {len(order)} runs; skipped: {sorted(skipped) or 'none'}", flush=True)
    runs = []
    t_all = time.time()
    for i, (config, name, rnd) in enumerate(order):
        r = run_one(config, name, rnd, args, outdir)
        status = "ok" if r["ok"] else f"FAILED {r['codes']}: {r.get('error', '')}"
        print(f"[compare] {i + 1}/{len(order)} {config.name} {name} r{rnd}: {status} ({r['wall_s']:.0f} s, "
              f"{time.time() - t_all:.0f} s total)", flush=True)
        runs.append(r)
    results = dict(
        command=args.command or _command(argv),
        quick=args.quick, started=time.strftime("%Y-%m-%d %H:%M", time.localtime(t_all)),
        duration_s=round(time.time() - t_all), machine=_machine(),
        configs=[dict(name=c.name, purpose=c.purpose, size=c.size.as_dict(), world=c.world, batch=c.batch,
                      approaches=list(c.approaches), rounds=c.rounds, goal_rounds=c.goal_rounds, warmup=c.warmup,
                      steps=c.steps)
                 for c in configs],
        skipped=skipped, runs=runs,
        labels={n: dict(label=a.label, family=a.family, offload=a.offload, note=a.note, kind=a.kind)
                for n, a in APPROACHES.items()},
    )
    os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
    with open(results_path, "w") as f:
        json.dump(results, f)
    report.write(results, args.out, plot_path)
    failed = [f"{r['config']}/{r['approach']}" for r in runs if not r["ok"]]
    print(f"[compare] wrote {args.out}, {results_path}; {len(failed)} failed runs {failed or ''}", flush=True)
    return 1 if failed else 0


def run_gpu(args, argv) -> int:
    """``--gpu``: every approach of zbench/gpu.py in its own process; print the table, write it and the figures."""
    from zbench import gpu

    names = [n for n in args.gpu_approaches.split(",") if n] or list(gpu.APPROACHES)
    unknown = [n for n in names if n not in gpu.APPROACHES]
    if unknown or args.gpu_size not in gpu.SIZES:
        print(f"[compare --gpu] unknown approach {unknown} or size {args.gpu_size!r}: approaches "
              f"{', '.join(gpu.APPROACHES)}; sizes {', '.join(gpu.SIZES)}", file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    if args.gpu_profile:
        os.makedirs(args.gpu_profile, exist_ok=True)
        env["ZBENCH_GPU_PROFILE"] = os.path.abspath(args.gpu_profile)
    started = time.time()
    results = gpu.run_all(names, args.gpu_size, args.python, args.timeout, env)
    peak = args.gpu_peak_tflops or gpu.PEAK_TFLOPS
    table = gpu.table(results, peak)
    device = next((r["device"] for r in results if "device" in r), "unknown")
    heading = (f"GPU comparison, {time.strftime('%Y-%m-%d', time.localtime(started))}, {device}, size {args.gpu_size}, "
               f"bf16-mixed, world size 1, MFU against {peak:.0f} TFLOPS")
    print(heading + "\n\n" + table, flush=True)
    outdir = os.path.join(args.workdir, "gpu")
    os.makedirs(outdir, exist_ok=True)
    results_path = args.results or os.path.join(outdir, "gpu.json")
    with open(results_path, "w") as f:
        json.dump(dict(command=args.command or _command(argv), heading=heading, size=args.gpu_size, peak_tflops=peak,
                       duration_s=round(time.time() - started), machine=_machine(), runs=results), f, indent=1)
    with open(args.out or os.path.join(outdir, "GPU.md"), "w") as f:
        f.write(f"{heading}\n\n{table}\n")
    failed = [r["name"] for r in results if "error" in r and not r["error"].startswith("skipped")]
    return 1 if failed else 0


def _command(argv) -> str:
    python = sys.executable
    if os.path.abspath(python).startswith(ROOT + os.sep):
        python = os.path.relpath(python, ROOT)
    env = "DS_ACCELERATOR=cpu " if os.environ.get("DS_ACCELERATOR") else ""
    return " ".join([env + python, os.path.relpath(os.path.abspath(__file__), ROOT)] + list(argv or sys.argv[1:]))


def _cpu_times() -> list[int] | None:
    """The machine's CPU time counters (``/proc/stat``, all CPUs, in clock ticks), or None where there is none."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def _steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """Of the CPU time that passed between two ``_cpu_times`` readings, the share the hypervisor gave to other guests
    (steal, the 8th counter): a run with a high share was slowed by the host, not by its approach."""
    if not before or not after or len(before) < 8:
        return None
    total = sum(a - b for a, b in zip(after[:8], before[:8]))
    return round((after[7] - before[7]) / total, 4) if total > 0 else None


def _loadavg() -> float | None:
    """The 1-minute load average: with one thread per rank, load well above the rank count means another process
    shared the CPUs during a run."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return None


def _machine() -> dict:
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("lightning", "deepspeed", "lightning_zero"):
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg)
        except Exception:
            versions[pkg] = None
    versions["lightning_zero_commit"] = _git_commit()
    return dict(cpus=os.cpu_count(), platform=platform.platform(), versions=versions,
                cpu=_cpu_model())


def _git_commit() -> str | None:
    """The commit benchmarked, with '+local changes' when lightning_zero/ differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "lightning_zero"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return (head + ("+local changes" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
