"""Did a change make a step cost more CPU? This checkout against another commit (default ``main``), side by side.

CPU time per step (both ranks together, ``time.process_time`` in each rank) moves far less than wall time on a
shared machine: other processes delay a rank, they do not make it compute more. So a change is measured by it: the
base commit is checked out into a git worktree under ``bench_work/``, and ``benchmarks/compare.py`` runs the chosen
approaches on the chosen configuration in each tree (each importing its own ``lightning_zero``), the two trees
alternating over the rounds (base, this; this, base; ...). A rise of more than ``--threshold`` (5%) in the median CPU
time per step is flagged, and the exit status is 1.

    python benchmarks/cpu_regression.py                          # zero1/2/3 at M-2 against main, 3 rounds (~15 min)
    python benchmarks/cpu_regression.py --base HEAD~3 --approaches lz_zero3 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worktree(base: str, where: Path) -> Path:
    """``base`` checked out (detached) at ``where``, made afresh."""
    if where.exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=ROOT, check=False)
    subprocess.run(["git", "worktree", "add", "--detach", str(where), base], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    return where


def run(tree: Path, config: str, approaches: str, out: Path, threads: int) -> dict:
    """One round of ``compare.py`` in ``tree``: its JSON results."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, "benchmarks/compare.py", "--only", config, "--approaches", approaches,
                    "--rounds", "1", "--goal-rounds", "0", "--threads", str(threads), "--results", str(out),
                    "--out", str(out.with_suffix(".md")), "--workdir", str(out.parent / "work")],
                   cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def per_step(results: dict) -> dict[str, dict[str, list[float]]]:
    """Per approach, every timed step's CPU seconds summed over the ranks (``cpu``) and wall seconds of its slowest
    rank (``wall``)."""
    out: dict[str, dict[str, list[float]]] = {}
    warm = {c["name"]: c["warmup"] for c in results["configs"]}
    for run_ in results["runs"]:
        ranks = run_.get("ranks") or []
        if not run_.get("ok") or not all("cpu" in r and "times" in r for r in ranks):
            continue
        steps = range(warm[run_["config"]], len(ranks[0]["cpu"]))
        mine = out.setdefault(run_["approach"], {"cpu": [], "wall": []})
        mine["cpu"].extend(sum(r["cpu"][s] for r in ranks) for s in steps)
        mine["wall"].extend(max(r["times"][s] for r in ranks) for s in steps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main", help="the commit to compare against")
    ap.add_argument("--config", default="M-2", help="a compare.py configuration (M-2, S-2, ...)")
    ap.add_argument("--approaches", default="lz_zero1,lz_zero2,lz_zero3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--threshold", type=float, default=0.05, help="the rise in CPU time per step that is flagged")
    args = ap.parse_args()
    work = ROOT / "bench_work" / "cpu_regression"
    work.mkdir(parents=True, exist_ok=True)
    trees = {"base": worktree(args.base, work / "base"), "this": ROOT}
    samples: dict[str, dict[str, dict[str, list[float]]]] = {"base": {}, "this": {}}
    for r in range(args.rounds):
        for name in (("base", "this") if r % 2 == 0 else ("this", "base")):
            results = run(trees[name], args.config, args.approaches, work / f"{name}-{r}.json", args.threads)
            for approach, values in per_step(results).items():
                kept = samples[name].setdefault(approach, {"cpu": [], "wall": []})
                for key in kept:
                    kept[key].extend(values[key])
            print(f"[cpu_regression] round {r + 1}/{args.rounds}: {name} done", flush=True)
    print(f"\nPer step, median ({args.config}, {args.rounds} rounds; base {args.base}): CPU time of both ranks, and "
          "the slowest rank's wall time beside it (noisier on a shared machine; only CPU time is judged):\n")
    print("| approach | CPU base (ms) | CPU this (ms) | this / base | wall base (ms) | wall this (ms) | this / base "
          "| |\n|---|--:|--:|--:|--:|--:|--:|---|")
    flagged = False
    for approach in args.approaches.split(","):
        base, this = samples["base"].get(approach), samples["this"].get(approach)
        if not base or not this:
            print(f"| {approach} | - | - | - | - | - | - | no steps measured |")
            continue
        cpu = [statistics.median(side["cpu"]) for side in (base, this)]
        wall = [statistics.median(side["wall"]) for side in (base, this)]
        rise = cpu[1] / cpu[0] > 1 + args.threshold
        flagged |= rise
        print(f"| {approach} | {1e3 * cpu[0]:.1f} | {1e3 * cpu[1]:.1f} | {cpu[1] / cpu[0]:.3f} | {1e3 * wall[0]:.1f} | "
              f"{1e3 * wall[1]:.1f} | {wall[1] / wall[0]:.3f} | "
              f"{'RISE over ' + format(args.threshold, '.0%') if rise else 'ok'} |")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
