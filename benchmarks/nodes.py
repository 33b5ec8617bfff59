#!/usr/bin/env python
"""Beyond one host (issue 37): two emulated nodes (tests/cluster.py: network namespaces joined by a veth shaped with
``tc tbf``), ``torchrun --nnodes 2 --nproc-per-node 2`` in each, gloo bound to the veth; the step time of flat zero3,
FSDP2 flat, hybrid sharding, FSDP2 HSDP, ZeRO++'s three options and Lightning DDP at three link rates, measured in one
run, and the bytes that cross the link per step from the strategy's accounting and from the link's counters.

[Note: the runs of the two-node benchmark]
Each configuration runs once per rate, on a fresh pair of namespaces: 4 CPU ranks (2 a node), one thread each, the
small GPT (``conf/model/gpt_small``: 0.84M parameters, 4 blocks of width 128), fp32, 32 sequences of 128 tokens a rank
and step (4,096 tokens), the same data for every configuration (benchmarks/zeropp.py's worker runs the ranks:
lightning_zero and DDP through Lightning's Trainer, which takes its nodes from torchrun; FSDP2 with ``fully_shard``
per Block and on the root, a 1-D mesh of 4 or a 2-D mesh of 2 x 2 for HSDP, in a plain loop with the same AdamW).

Rates: the compute per byte that crosses the link is matched to real clusters (shared/DESIGN.md). One core of this
machine does ~96 GFLOP/s on the model's matmuls: at 40 Mbit/s (5 MB/s) that is ~2e4 FLOP per byte across, as an H100
node (~1e15 FLOP/s) with 400 Gbit/s between nodes; at 10 Mbit/s ~8e4, as the ZeRO++ paper's cluster of 100 Gbit/s;
1 Gbit/s is a link fast enough that compute dominates.

Measured: per step, the slowest rank's time from one ``on_train_batch_start`` (or loop iteration) to the next, the
median over ``--steps`` steps after ``--warmup``; the bytes every node sent on the link (the veth's ``tx_bytes``,
TCP/IP headers included, read by each rank at the start of the first and the last measured step) and, for
lightning_zero, ``comm_stats.cross_group_bytes`` summed over the ranks, both per step; the link's use, the bytes a
node sent per step over what the rate carries in a step (the mean of the two directions). Four single-threaded ranks
time-slice two cores, so the steps' compute is twice a rank's own: the ratios, at one rate, are what compare.

    python benchmarks/nodes.py --rounds 2                 # the table: 6 configurations x 3 rates, twice (~40 min, root)
    python benchmarks/nodes.py --rates 40 --configs zero3,fsdp2 --steps 3
    python benchmarks/nodes.py --report-only              # print the table of benchmarks/results/nodes.json

Writes ``--results`` (default benchmarks/results/nodes.json); BENCHMARKS.md renders the last run's
(``compare.py --report-only benchmarks/results/full.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

RESULTS = os.path.join(HERE, "results", "nodes.json")
ZEROPP = os.path.join(HERE, "zeropp.py")
NODES, PER_NODE = 2, 2
BATCH = 32
#: Mbit/s each way, fastest first.
RATES = (1000.0, 40.0, 10.0)
MODEL = dict(vocab_size=256, n_layer=4, n_head=4, d_model=128, seq_len=128)
#: ``--quick``: a check of the script, not a measurement.
TINY = dict(vocab_size=256, n_layer=2, n_head=2, d_model=64, seq_len=32)
OPTIMIZER = dict(lr=2e-3, weight_decay=0.1, warmup_steps=20, min_lr_ratio=0.1, betas=(0.9, 0.95))


@dataclass(frozen=True)
class NodeConfig:
    """One row: ``kind`` "lz" (ZeroStrategy's ``options``), "fsdp2" (its mesh) or "ddp"."""

    name: str
    label: str
    kind: str
    options: dict = field(default_factory=dict)


CONFIGS = [
    NodeConfig("zero3", "flat zero3", "lz", dict(stage=3)),
    NodeConfig("fsdp2", "FSDP2 flat", "fsdp2", dict(mesh=[NODES * PER_NODE])),
    NodeConfig("zero3_hybrid", "hybrid (`shard_group_size=\"node\"`)", "lz", dict(stage=3, shard_group_size="node")),
    NodeConfig("fsdp2_hsdp", "FSDP2 HSDP (2x2 mesh)", "fsdp2", dict(mesh=[NODES, PER_NODE])),
    NodeConfig("zero3_zeropp", "qwZ + hpZ + qgZ int4", "lz",
               dict(stage=3, quantize_weights=True, hpz_group_size="node", quantize_grads="int4")),
    NodeConfig("ddp", "Lightning DDP", "ddp"),
]


def run(config: NodeConfig, rate: float, model: dict, warmup: int, steps: int, workdir: str, timeout: float) -> dict:
    """``config`` on a fresh pair of emulated nodes joined at ``rate`` Mbit/s: its per-rank records (zeropp.py's
    worker), the wall time and the exit codes of both torchruns."""
    from tests.cluster import LINK, EmulatedCluster, wait_all

    out = os.path.join(workdir, f"{config.name}.{rate:g}")
    spec = dict(config=config.name, kind=config.kind, options=config.options, model=model, seed=1, batch=BATCH,
                steps_total=warmup + steps + 1, marked=[warmup, warmup + steps], out=out, optimizer=OPTIMIZER)
    env = dict(LZ_LINK_COUNTER=f"/sys/class/net/{LINK}/statistics/tx_bytes",
               PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    t0 = time.time()
    with EmulatedCluster(rate) as cluster:
        procs = [cluster.torchrun(node, [ZEROPP, "--worker", json.dumps(spec)], PER_NODE, env=env,
                                  log=f"{out}.node{node}.log") for node in range(NODES)]
        codes = wait_all(procs, timeout)
    ranks = {}
    for rank in range(NODES * PER_NODE):
        path = f"{out}.rank{rank}.json"
        if os.path.exists(path) and os.path.getmtime(path) >= t0:
            with open(path) as f:
                ranks[rank] = json.load(f)
    if len(ranks) != NODES * PER_NODE:
        with open(f"{out}.node0.log") as f:
            tail = [line for line in f.read().splitlines() if line.strip() and "hostname" not in line][-6:]
        raise RuntimeError(f"{config.name} at {rate:g} Mbit/s failed, exit codes {codes}: " + " | ".join(tail))
    return dict(ranks=ranks, codes=codes, wall_s=round(time.time() - t0, 1))


def measure(config: NodeConfig, rate: float, model: dict, warmup: int, steps: int, workdir: str,
            timeout: float) -> dict:
    """One configuration at one rate: step time, bytes across per step (link and strategy), the link's use."""
    result = run(config, rate, model, warmup, steps, workdir, timeout)
    ranks = result["ranks"]
    first, last = warmup, warmup + steps
    per_step = [max(ranks[r]["entries"][i + 1] - ranks[r]["exits"][i] for r in ranks) for i in range(first, last)]
    step_s = statistics.median(per_step)
    leaders = [node * PER_NODE for node in range(NODES)]  # one reading of each node's counter
    sent = [(ranks[r]["snapshots"][1]["link"] - ranks[r]["snapshots"][0]["link"]) / steps for r in leaders]
    row = dict(name=config.name, label=config.label, rate=rate, step_s=step_s, step_s_all=per_step,
               link_bytes=sum(sent), link_use=statistics.fmean(s / (rate * 1e6 / 8 * step_s) for s in sent),
               wall_s=result["wall_s"], exit_codes=result["codes"],
               losses=[statistics.fmean(ranks[r]["losses"][i] for r in ranks) for i in range(last + 1)])
    if "cross" in ranks[0]["snapshots"][0]:
        row["stats_bytes"] = sum(ranks[r]["snapshots"][1]["cross"] - ranks[r]["snapshots"][0]["cross"]
                                 for r in ranks) / steps
    return row


# ------------------------------------------------------------------------------------------------------ report


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f} MB"


def merged(rows: list[dict]) -> dict[tuple[str, float], dict]:
    """One row per configuration and rate: over ``--rounds``, the median step and the mean bytes and link use."""
    by_key: dict[tuple[str, float], list[dict]] = {}
    for row in rows:
        by_key.setdefault((row["name"], row["rate"]), []).append(row)
    out = {}
    for key, group in by_key.items():
        row = dict(group[0], step_s=statistics.median(r["step_s"] for r in group),
                   step_s_rounds=[r["step_s"] for r in group],
                   link_bytes=statistics.fmean(r["link_bytes"] for r in group),
                   link_use=statistics.fmean(r["link_use"] for r in group))
        if "stats_bytes" in row:
            row["stats_bytes"] = statistics.fmean(r["stats_bytes"] for r in group)
        out[key] = row
    return out


def plot(results: dict, path: str) -> str | None:
    """Each configuration's step time against the link's rate (log-log), one line each: ``path`` written, or why
    not (matplotlib, from the ``bench`` extra, missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    at = merged(results["rows"])
    rates = results["rates"]
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for config in CONFIGS:
        points = [(rate, at[(config.name, rate)]["step_s"]) for rate in rates if (config.name, rate) in at]
        if points:
            ax.plot(*zip(*points), marker="o", label=config.label.replace("`", ""))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link between the two nodes (Mbit/s)")
    ax.set_ylabel("seconds a step (median)")
    ax.set_title("2 emulated nodes x 2 CPU ranks, small GPT")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(results: dict) -> str:
    """The issue's table: flat zero3's seconds a step at each rate, every other row as a ratio to it at that rate;
    the bytes across a step (both directions, the link's counters and the strategy's) and the link's use."""
    rates = results["rates"]
    at = merged(results["rows"])
    base = {rate: at.get(("zero3", rate)) for rate in rates}
    slowest = rates[-1]
    lines = [
        f"{results['started']}, `{results['command']}`: 2 emulated nodes x 2 CPU ranks (network namespaces, a veth "
        f"shaped with `tc tbf`, torchrun and gloo on the veth), the small GPT (fp32), {BATCH} x "
        f"{results['model']['seq_len']} tokens a rank and step; the median step of {results['steps']} after "
        f"{results['warmup']} warm-up steps{_rounds(results.get('rounds', 1))}; commit "
        f"{results.get('commit') or 'unknown'}. Flat zero3's row in "
        "seconds a step, the others as a ratio to it at the same rate (below 1: faster). Bytes across: what both "
        "nodes sent on the link per step (TCP/IP headers included) and what the strategy counted "
        "(`comm_stats.cross_group_bytes`, all ranks); link use: bytes a node sent a step over what the rate carries "
        f"in that step, at {slowest:g} Mbit/s.",
        "",
        "| | " + " | ".join(f"{rate:g} Mbit/s" for rate in rates) + " | bytes across (link) | comm_stats | link use |",
        "|---|" + "--:|" * (len(rates) + 3),
    ]
    for config in CONFIGS:
        cells = [config.label + (" (seconds a step)" if config.name == "zero3" else "")]
        for rate in rates:
            row, ref = at.get((config.name, rate)), base[rate]
            if row is None:
                cells.append("-")
            elif config.name == "zero3" or ref is None:
                cells.append(f"{row['step_s']:.2f}")
            else:
                cells.append(f"{row['step_s'] / ref['step_s']:.2f}x")
        measured = [at[(config.name, rate)] for rate in rates if (config.name, rate) in at]
        zero3 = [at[("zero3", rate)] for rate in rates if ("zero3", rate) in at]
        if measured:
            link = statistics.fmean(r["link_bytes"] for r in measured)
            stats = [r["stats_bytes"] for r in measured if "stats_bytes" in r]
            ref_link = statistics.fmean(r["link_bytes"] for r in zero3) if zero3 else None
            cells.append(_mb(link) if config.name == "zero3" or not ref_link else f"{link / ref_link:.2f}x")
            cells.append(_mb(statistics.fmean(stats)) if stats else "-")
            slow = at.get((config.name, slowest))
            cells.append(f"{100 * slow['link_use']:.0f}%" if slow else "-")
        else:
            cells += ["-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"| {f['name']} at {f['rate']:g} Mbit/s | failed: `{f['error'][-300:]}` |" + " |" * (len(rates) + 1)
              for f in results.get("failed", [])]
    lines += ["", *goals(at, rates)]
    if results.get("rounds", 1) > 1:
        lines += ["", "Each round's step, in seconds (rounds of one configuration that disagree point at the machine's "
                  "load at the time):", ""]
        lines += [f"- {rate:g} Mbit/s: " + "; ".join(
            f"{c.label} {' / '.join(f'{t:.2f}' for t in at[(c.name, rate)]['step_s_rounds'])}"
            for c in CONFIGS if (c.name, rate) in at) for rate in rates]
    return "\n".join(lines)


def _rounds(rounds: int) -> str:
    return f", the median of {rounds} rounds of every configuration in alternating order" if rounds > 1 else ""


def goals(at: dict, rates: list[float]) -> list[str]:
    """Issue 37's goals, each with its verdict in this run."""
    out = []
    for rate in [r for r in rates if r <= 40]:
        z, f, h, hs = (at.get((n, rate)) for n in ("zero3", "fsdp2", "zero3_hybrid", "fsdp2_hsdp"))
        if z and f:
            out.append(f"- {rate:g} Mbit/s: flat zero3 {z['step_s']:.2f} s against FSDP2 flat {f['step_s']:.2f} s "
                       f"({'met' if z['step_s'] <= f['step_s'] else 'NOT met'}), bytes across "
                       f"{z['link_bytes'] / f['link_bytes']:.2f}x FSDP2's "
                       f"({'met' if z['link_bytes'] <= f['link_bytes'] else 'NOT met'}).")
        if h and hs:
            out.append(f"- {rate:g} Mbit/s: hybrid {h['step_s']:.2f} s against HSDP {hs['step_s']:.2f} s "
                       f"({'met' if h['step_s'] <= hs['step_s'] else 'NOT met'}).")
    fast = [r for r in rates if r > 40]
    for rate in fast:
        z = at.get(("zero3", rate))
        slower = [(c.label, at[(c.name, rate)]["step_s"] / z["step_s"]) for c in CONFIGS
                  if z and (c.name, rate) in at and at[(c.name, rate)]["step_s"] > 1.1 * z["step_s"]]
        if z:
            out.append(f"- {rate:g} Mbit/s: " + ("no configuration more than 10% slower than flat zero3." if not slower
                       else "slower than flat zero3 by more than 10%: " + ", ".join(f"{label} {ratio:.2f}x"
                                                                                   for label, ratio in slower) + "."))
    return out


# ------------------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="", help=f"comma list of {', '.join(c.name for c in CONFIGS)} (default: all)")
    ap.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES), help="Mbit/s, comma list")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="runs of every configuration, in alternating order (a "
                    "shared machine's load then weighs on each alike)")
    ap.add_argument("--quick", action="store_true", help="a tiny model (a check of the script, not a measurement)")
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--workdir", default=os.path.join(ROOT, "bench_work", "nodes"))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.results) as f:
            results = json.load(f)
        plot(results, os.path.splitext(args.results)[0] + ".png")
        print(render(results))
        return 0
    import zeropp
    from tests.cluster import unavailable

    why = unavailable()
    if why is not None:
        print(f"[nodes] {why}", file=sys.stderr)
        return 2
    by_name = {c.name: c for c in CONFIGS}
    names = [n for n in args.configs.split(",") if n] or list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        print(f"[nodes] unknown configuration {unknown}: allowed {', '.join(by_name)}", file=sys.stderr)
        return 2
    rates = [float(r) for r in args.rates.split(",") if r]
    model = TINY if args.quick else MODEL
    os.makedirs(args.workdir, exist_ok=True)
    command = " ".join(["python benchmarks/nodes.py", *(argv if argv is not None else sys.argv[1:])])
    results = dict(started=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=command, model=model,
                   rates=rates, warmup=args.warmup, steps=args.steps, rounds=args.rounds, rows=[], failed=[],
                   commit=zeropp._commit())
    for rate in rates:
        for round_, name in [(r, n) for r in range(args.rounds) for n in (names if r % 2 == 0 else names[::-1])]:
            try:
                row = measure(by_name[name], rate, model, args.warmup, args.steps, args.workdir, args.timeout)
                row["round"] = round_
            except (RuntimeError, KeyError, IndexError) as error:
                print(f"[nodes] {error}", flush=True)
                results["failed"].append(dict(name=name, rate=rate, error=str(error)[-600:]))
                continue
            results["rows"].append(row)
            stats = f", comm_stats {row['stats_bytes'] / 1e6:.2f} MB" if "stats_bytes" in row else ""
            print(f"[nodes] {name} at {rate:g} Mbit/s: step {row['step_s']:.2f} s, across {row['link_bytes'] / 1e6:.2f}"
                  f" MB a step on the link{stats}, link use {100 * row['link_use']:.0f}% ({row['wall_s']:.0f} s)",
                  flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    with open(args.results, "w") as f:
        json.dump(results, f, indent=1)
    png = plot(results, os.path.splitext(args.results)[0] + ".png")
    print(render(results) + ("\n\n(plot: " + png + ")" if png else "\n\n(no plot: matplotlib is not installed)"),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
