#!/usr/bin/env python
"""What issue 39's zero3 features cost, on the model, data, processes and clock of ``compare.py`` (zbench/), M-2:

* ``compile``: torch.compile (inductor, CPU) under zero3 against eager zero3, and against compiled DDP and FSDP2. Each
  transformer Block compiled in place before any wrapping (``block.compile()``, as torchtitan compiles FSDP2's blocks)
  for torch DDP, FSDP2 (reshard after forward) and zero3, and zero3 with the whole model compiled
  (``model.compile()``: its graph ends at every unit's hooks), beside the same approaches eager. Compiling happens in
  the first warm-up step, so the timed steps are the compiled code's.
* ``average``: what Lightning's ``EMAWeightAveraging`` adds to a rank's memory: the RSS at the end of the run, its peak
  over the training steps and over the whole run (the callback's deep copy of the model at setup, before zero3 cuts
  it to rows), above the RSS before the model was built, with and without the callback, for Lightning DDP (the whole
  average: 4Ψ) and zero3, plain and offloaded (this rank's rows: 4Ψ/N).

Runs alternate round by round (zbench/plan.py). Writes ``results/zero3_features_<what>.json`` and prints the table
that BENCHMARKS.md quotes.

    python benchmarks/zero3_features.py compile                  # ~25-35 min on 2 busy cores
    python benchmarks/zero3_features.py average                  # ~5 min
    python benchmarks/zero3_features.py compile --size tiny --rounds 1 --steps 2   # a minute or two: does it run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from compare import ROOT, _machine, run_one  # noqa: E402
from zbench.approaches import APPROACHES  # noqa: E402
from zbench.model import SIZES  # noqa: E402
from zbench.plan import Config, schedule  # noqa: E402

MB = 2**20
#: (approach, its counterpart without the feature) in table order.
PAIRS = {
    "compile": [("ddp_compiled", "ddp"), ("fsdp2_compiled", "fsdp2"), ("lz_zero3_compiled", "lz_zero3"),
                ("lz_zero3_compiled_model", "lz_zero3")],
    "average": [("lit_ddp_ema", "lit_ddp"), ("lz_zero3_ema", "lz_zero3"), ("lz_zero3_offload_ema", "lz_zero3_offload")],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=sorted(PAIRS))
    ap.add_argument("--size", default="M", choices=sorted(SIZES))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per run (the first one compiles)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run (inductor compiles in the first step)")
    ap.add_argument("--results", default=None, help="default: benchmarks/results/zero3_features_<what>.json")
    ap.add_argument("--workdir", default=os.path.join(ROOT, "bench_work", "zero3_features"))
    args = ap.parse_args(argv)
    args.python, args.pyspy, args.torch_profile, args.timers = sys.executable, "", "", ""
    results_path = args.results or os.path.join(HERE, "results", f"zero3_features_{args.what}.json")
    names = list(dict.fromkeys(n for pair in PAIRS[args.what] for n in pair))
    size = SIZES[args.size]
    config = Config(f"{size.name}-{args.world}-{args.what}", args.what, size, args.world, 2, tuple(names),
                    args.rounds, args.warmup, args.steps)
    os.makedirs(args.workdir, exist_ok=True)
    runs, started = [], time.time()
    order = schedule([config])
    for i, (c, name, rnd) in enumerate(order):
        run = run_one(c, name, rnd, args, args.workdir)
        print(f"[{args.what}] {i + 1}/{len(order)} {name} r{rnd}: {'ok' if run['ok'] else run.get('error')} "
              f"({run['wall_s']:.0f} s)", flush=True)
        runs.append(run)
    command = " ".join([os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])])
    results = dict(command=f"python {command}", started=time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
                   duration_s=round(time.time() - started), machine=_machine(), runs=runs,
                   configs=[dict(name=config.name, purpose=config.purpose, size=size.as_dict(), world=config.world,
                                 batch=config.batch, approaches=names, rounds=config.rounds, goal_rounds=0,
                                 warmup=config.warmup, steps=config.steps)])
    os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
    with open(results_path, "w") as f:
        json.dump(results, f)
    print("\n".join(TABLES[args.what](results)))
    return 0 if all(r["ok"] for r in runs) else 1


def compile_table(results: dict) -> list[str]:
    """Step time per approach, compiled against eager, and zero3 compiled against the peers compiled."""
    from zbench.report import summarize

    (rows,) = summarize(results).values()
    lines = ["| approach | step ms median (min-max) | CPU ms/step (all ranks) | vs eager | loss after last step |",
             "|---|---|---|---|---|"]
    for compiled, eager in PAIRS["compile"]:
        for name in (eager, compiled) if compiled != "lz_zero3_compiled_model" else (compiled,):
            row = rows.get(name, {})
            if not row.get("ok"):
                lines.append(f"| {APPROACHES[name].label} | failed: {row.get('error', 'not run')[:80]} | | | |")
                continue
            versus = f"{row['step_s'] / rows[eager]['step_s']:.2f}" if name == compiled and rows[eager].get("ok") \
                else ""
            cpu = f"{1000 * row['cpu_s']:.0f}" if row.get("cpu_s") is not None else "n/a"
            lines.append(f"| {APPROACHES[name].label} | {1000 * row['step_s']:.0f} ({1000 * row['step_min']:.0f}-"
                         f"{1000 * row['step_max']:.0f}) | {cpu} | {versus} | {row['final_loss']:.6f} |")
    ours = rows.get("lz_zero3_compiled", {})
    for peer in ("ddp_compiled", "fsdp2_compiled"):
        if ours.get("ok") and rows.get(peer, {}).get("ok"):
            lines.append(f"\nzero3 compiled / {APPROACHES[peer].label}: {ours['step_s'] / rows[peer]['step_s']:.2f}")
    return lines


def average_table(results: dict) -> list[str]:
    """Per rank (the largest), MB above the RSS before the model was built: at the end of the run and at the peak of
    the training steps, median over rounds; what the callback adds, against what its average should hold."""
    n_params = world = None
    figures = {}
    for name in {n for pair in PAIRS["average"] for n in pair}:
        ranks = [r["ranks"] for r in results["runs"] if r["approach"] == name and r["ok"]]
        if ranks:
            n_params, world = ranks[0][0]["n_params"], len(ranks[0])
            figures[name] = [statistics.median(max(d[key] - d["rss_base"] for d in run) for run in ranks) / MB
                             for key in ("rss_end", "peak_train", "peak_rss")]
    lines = ["| approach | RSS at end MB | training peak MB | whole-run peak MB | added by EMA: at end / training "
             "peak / run peak MB | the average's fp32 rows MB |", "|---|---|---|---|---|---|"]
    for with_ema, without in PAIRS["average"]:
        for name in (without, with_ema):
            if name not in figures:
                lines.append(f"| {APPROACHES[name].label} | failed | | | | |")
                continue
            added = expected = ""
            if name == with_ema and without in figures:
                added = " / ".join(f"{a - b:+.1f}" for a, b in zip(figures[name], figures[without]))
                expected = f"{4 * n_params / MB / (1 if name.startswith('lit_') else world):.1f}"
            cells = " | ".join(f"{v:.1f}" for v in figures[name])
            lines.append(f"| {APPROACHES[name].label} | {cells} | {added} | {expected} |")
    return lines


TABLES = {"compile": compile_table, "average": average_table}


if __name__ == "__main__":
    sys.exit(main())
