"""From raw per-rank records to figures per approach, BENCHMARKS.md tables and the plot.

[Note: how a figure is made from the runs]
- step time: per step, the slowest rank's time; pooled over the timed steps of all rounds; median (min, max).
  A round (one pass over every approach, plan.py) where most approaches ran more than ``DISTURBED`` times slower
  (median) than their own best round was disturbed for all of them, and is left out of every approach's pool and
  flagged in the per-round lists; on a quiet machine rounds agree within ~5% and nothing is left out. Leaving out an
  approach's slow rounds alone would pool each approach's luckiest rounds and skew the ratios between them.
- CPU time: per step, the CPU time of all ranks' processes together (worker.py, [Note: CPU time]), pooled like the
  step time, median; beside it, per round, the share of the machine's CPU time the hypervisor stole during the run.
- throughput: tokens of one global step (ranks x batch x sequence length) / median step time.
- model-state bytes: parameters + gradients + optimizer states held by a rank after backward (measure.py), the
  largest rank's figure; "all tensors" adds every other live tensor (buckets, internal buffers).
- peak RSS: the largest rank's peak RSS above its "base" (the RSS after imports, process-group set-up and a
  throw-away tiny training step, before the model is built), median over rounds; "training" is the peak during the
  training steps (high-water mark reset after set-up), "run" the peak over the whole process life (which also
  includes building the full model on every rank and wrapping it). Per phase (forward+backward / optimizer step):
  the most the RSS rose above its value at the start of the step.
- communication: per timed step, ring-algorithm bytes of the collectives issued (measure.py), median, in units of
  ``(N-1)/N * Psi * 4`` bytes (DDP = 2, textbook ZeRO-3 = 3); "wire" is bytes written to sockets per step.
- loss: the mean over ranks of the loss at the last step; every approach must agree with DDP to float re-association.
"""

from __future__ import annotations

import json
import math
import os
import statistics

MB = 2**20
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A round where most approaches' median step time exceeds their best round's by this factor is "disturbed" (another
#: process took the CPU for a while: seen as whole rounds 1.5-2x slower on a shared machine) and left out of every
#: approach's pooled step times; it is still listed per round.
DISTURBED = 1.25

# Relative tolerance for "losses agree": fp32 sums in another order differ in the last bits, growing over the steps.
LOSS_RTOL = 1e-4


def _step_times(run: dict, warm: int) -> list[float]:
    """Per timed step of a run, the slowest rank's time."""
    ranks = sorted(run["ranks"], key=lambda d: d["rank"])
    return [max(d["times"][s] for d in ranks) for s in range(warm, len(ranks[0]["times"]))]


def _disturbed_rounds(runs_by: dict[tuple[str, str], list[dict]], configs: dict) -> dict[str, set]:
    """Per configuration, the rounds where most approaches ran ``DISTURBED`` times slower than their best round."""
    slow: dict[str, dict] = {name: {} for name in configs}
    for (cname, _), runs in runs_by.items():
        medians = {run.get("round"): statistics.median(_step_times(run, configs[cname]["warmup"]))
                   for run in runs if run["ok"]}
        if not medians:
            continue
        best = min(medians.values())
        for round_, median in medians.items():
            counts = slow[cname].setdefault(round_, [0, 0])
            counts[0] += median > DISTURBED * best
            counts[1] += 1
    return {cname: {r for r, (n_slow, n) in rounds.items() if 2 * n_slow > n} for cname, rounds in slow.items()}


def summarize(results: dict) -> dict[str, dict[str, dict]]:
    """config name -> approach -> figures (see [Note: how a figure is made from the runs])."""
    from zbench.measure import ring_bytes  # imports torch: only when figures are made

    configs = {c["name"]: c for c in results["configs"]}
    out: dict[str, dict[str, dict]] = {name: {} for name in configs}
    runs_by: dict[tuple[str, str], list[dict]] = {}
    for run in results["runs"]:
        runs_by.setdefault((run["config"], run["approach"]), []).append(run)
    disturbed_by_config = _disturbed_rounds(runs_by, configs)
    for (cname, name), runs in runs_by.items():
        c = configs[cname]
        ok = [r for r in runs if r["ok"]]
        if not ok:
            out[cname][name] = dict(ok=False, error=runs[0].get("error", ""), codes=runs[0].get("codes"))
            continue
        warm, world = c["warmup"], c["world"]
        times, cpu, round_medians, comm, wire, peaks, bases, finals = [], [], [], [], [], [], [], []
        train_peaks, phase_peaks = [], {}
        per_round = [_step_times(run, warm) for run in ok]
        disturbed = [i for i, run in enumerate(ok) if run.get("round") in disturbed_by_config[cname]]
        for i, run in enumerate(ok):
            ranks = sorted(run["ranks"], key=lambda d: d["rank"])
            per_step = per_round[i]
            if i not in disturbed:
                times += per_step
                if all("cpu" in d for d in ranks):
                    cpu += [sum(d["cpu"][s] for d in ranks) for s in range(warm, len(ranks[0]["cpu"]))]
            round_medians.append(statistics.median(per_step))
            train_peaks.append(max(d.get("peak_train", d["peak_rss"]) - d["rss_base"] for d in ranks))
            for d in ranks:
                for k, v in d.get("phase_peaks", {}).items():
                    phase_peaks.setdefault(k, []).append(v)
            for d in ranks:
                for s in range(warm, len(d["comm"])):
                    comm.append(ring_bytes(d["comm"][s], world))
                    wire.append(d["wire"][s])
            peaks.append(max(d["peak_rss"] for d in ranks))
            bases.append(max(d["rss_base"] for d in ranks))
            losses = [statistics.fmean(d["losses"][s] for d in ranks) for s in range(len(ranks[0]["losses"]))]
            finals.append(losses)
        first = sorted(ok[0]["ranks"], key=lambda d: d["rank"])
        r0 = first[0]
        n_params = r0["n_params"]
        psi_unit = n_params * 4 * (world - 1) / world if world > 1 else float("nan")
        mem = [d["memory"] for d in first]
        biggest = max(mem, key=lambda m: m["total"])
        med = statistics.median(times)
        tokens = world * c["batch"] * c["size"]["seq"]
        ops = {}
        for op, (calls, nbytes) in r0["comm"][warm].items():
            ops[op] = (calls, nbytes)
        row = dict(
            ok=True, n_params=n_params, world=world, rounds=len(ok), failed_rounds=len(runs) - len(ok),
            step_s=med, step_min=min(times), step_max=max(times), round_medians=round_medians,
            cpu_s=statistics.median(cpu) if cpu else None, round_steal=[run.get("steal") for run in ok],
            tokens_per_s=tokens / med,
            model_state=max(m["model_state"] for m in mem), params=biggest["params"], grads=biggest["grads"],
            optim=biggest["optim"], other=biggest["other"], all_tensors=max(m["total"] for m in mem),
            model_state_ranks=[m["model_state"] for m in mem], detail=biggest.get("detail", {}),
            disturbed_rounds=disturbed,
            peak_rss=statistics.median(peaks), rss_base=statistics.median(bases),
            peak_above_base=statistics.median(p - b for p, b in zip(peaks, bases)),
            train_peak_above_base=statistics.median(train_peaks),
            phase_peaks={k: max(v) for k, v in phase_peaks.items()},
            comm_bytes=statistics.median(comm) if comm else 0.0,
            comm_psi=(statistics.median(comm) / psi_unit) if comm and world > 1 else 0.0,
            wire_bytes=statistics.median(wire) if wire else 0,
            ops=ops, losses=finals[0], final_loss=finals[0][-1],
            rounds_agree=all(f == finals[0] for f in finals),
            setup_s=statistics.median(d["setup_s"] for d in first),
            info=r0.get("info", {}), own_comm=r0.get("extra", {}).get("own_comm"),
        )
        own = r0.get("info", {}).get("own_model_state")
        if own:
            row["own_model_state"] = own
        out[cname][name] = row
    return out


# ----------------------------------------------------------------------------------------------------------------------
# formatting helpers
# ----------------------------------------------------------------------------------------------------------------------
def _mb(x) -> str:
    return f"{x / MB:.1f}"


def _ms(x) -> str:
    return f"{1000 * x:.0f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if b else "-"


def _label(results, name) -> str:
    return results["labels"][name]["label"]


def _order(results, names):
    ref = list(results["labels"])
    return sorted(names, key=ref.index)


def _loss_ref(rows: dict):
    for name in ("ddp", "lit_ddp", "single", "lit_single"):
        if rows.get(name, {}).get("ok"):
            return name
    return next((n for n, r in rows.items() if r.get("ok")), None)


def _config_line(c: dict, n_params: int | None) -> str:
    s = c["size"]
    p = f"{n_params / 1e6:.2f} M parameters, " if n_params else ""
    return (f"model {s['name']}: {p}d_model={s['d_model']}, {s['n_layer']} layers, {s['n_head']} heads, vocab "
            f"{s['vocab']}, sequence {s['seq']}; {c['world']} rank(s) x {c['batch']} sequences; "
            f"{c['warmup']} warm-up + {c['steps']} timed steps per run, {c['rounds']} round(s)"
            + (f", then {c['goal_rounds']} more of the approaches the goal figures compare"
               if c.get("goal_rounds") else ""))


def main_table(results, cfg, rows) -> list[str]:
    ref = _loss_ref(rows)
    lines = [
        "| approach | step ms median (min-max) | tokens/s | model state MB/rank (params/grads/optim) | all tensors "
        "MB/rank | peak RSS above base MB/rank: training (whole run) | rise in step MB: fwd+bwd / opt step | "
        "comm/step xPsi (MB) | socket MB/step | loss after last step (vs " + (ref or "-") + ") |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in _order(results, rows):
        r = rows[name]
        label = _label(results, name)
        if not r.get("ok"):
            lines.append(f"| {label} | FAILED | {r.get('error', '')[:160]} | | | | | | | |")
            continue
        d = r["final_loss"] - rows[ref]["final_loss"] if ref else 0.0
        lines.append(
            f"| {label} | {_ms(r['step_s'])} ({_ms(r['step_min'])}-{_ms(r['step_max'])}) | {r['tokens_per_s']:.0f} "
            f"| {_mb(r['model_state'])} ({_mb(r['params'])}/{_mb(r['grads'])}/{_mb(r['optim'])}) "
            f"| {_mb(r['all_tensors'])} | {_mb(r['train_peak_above_base'])} ({_mb(r['peak_above_base'])}) "
            f"| {_mb(r['phase_peaks'].get('fwd_bwd', 0))} / {_mb(r['phase_peaks'].get('step', 0))} "
            f"| {r['comm_psi']:.2f} ({_mb(r['comm_bytes'])}) | {_mb(r['wire_bytes'])} "
            f"| {r['final_loss']:.6f} ({d:+.1e}) |")
    for name in results.get("skipped", {}):
        if name in cfg["approaches"]:
            lines.append(f"| {_label(results, name)} | skipped: {results['skipped'][name]} | | | | | | | | |")
    return lines


#: Like-for-like peers of each lightning_zero approach: same family (what is sharded), no offload.
def peers_of(results, rows, name) -> list[str]:
    fam = results["labels"][name]["family"]
    return [n for n in _order(results, rows) if n != name and not n.startswith("lz_") and rows[n].get("ok")
            and results["labels"][n]["family"] == fam and not results["labels"][n]["offload"]]


def comparison_table(results, rows) -> list[str]:
    lines = ["| lightning_zero | peer | step time ratio (lz / peer) | model state ratio | all tensors ratio | "
             "training peak RSS above base ratio | comm ratio |", "|---|---|---|---|---|---|---|"]
    for name in _order(results, [n for n in rows if n.startswith("lz_") and rows[n].get("ok")]):
        lz = rows[name]
        peers = peers_of(results, rows, name)
        if results["labels"][name]["family"] in ("zero1", "zero2"):
            peers = [p for p in ("ddp", "lit_ddp") if rows.get(p, {}).get("ok")] + peers
        for p in peers:
            r = rows[p]
            lines.append(
                f"| {_label(results, name)} | {_label(results, p)} | {_ratio(lz['step_s'], r['step_s'])} "
                f"| {_ratio(lz['model_state'], r['model_state'])} | {_ratio(lz['all_tensors'], r['all_tensors'])} "
                f"| {_ratio(lz['train_peak_above_base'], r['train_peak_above_base'])} "
                f"| {_ratio(lz['comm_bytes'], r['comm_bytes']) if r['comm_bytes'] else '-'} |")
    return lines


def goals_table(results, summary) -> list[str]:
    """The issue's acceptance criteria, checked on the main configuration."""
    main = next((c for c in results["configs"] if c["purpose"] == "main"), None)
    if main is None:
        return []
    rows = summary[main["name"]]

    def ok(n):
        return rows.get(n, {}).get("ok")

    lines = ["| criterion | measured | verdict |", "|---|---|---|"]

    def crit(text, a, b, limit, what="step"):
        if not (ok(a) and ok(b)):
            lines.append(f"| {text} | not measured ({a if not ok(a) else b} missing) | - |")
            return
        if what == "step":
            ratio = rows[a]["step_s"] / rows[b]["step_s"]
            lines.append(f"| {text} | {ratio:.3f} | {'met' if ratio <= limit else 'NOT met'} |")
            return
        state = rows[a]["model_state"] / rows[b]["model_state"]
        rss = rows[a]["train_peak_above_base"] / rows[b]["train_peak_above_base"]
        verdict = "met" if state <= limit and rss <= limit else "NOT met"
        lines.append(f"| {text} | model state {state:.3f}, training peak RSS {rss:.3f} | {verdict} |")

    crit("zero3 step time <= FSDP2 (reshard_after_forward=True)", "lz_zero3", "fsdp2", 1.0)
    crit("zero3 step time <= DeepSpeed ZeRO-3", "lz_zero3", "ds_z3", 1.0)
    for stage in (1, 2):
        crit(f"zero{stage} step time within 5% of torch DDP", f"lz_zero{stage}", "ddp", 1.05)
        crit(f"zero{stage} step time within 5% of Lightning DDP (same Trainer path)", f"lz_zero{stage}", "lit_ddp",
             1.05)
    for name in ("lz_zero1", "lz_zero2", "lz_zero3", "lz_zero3_noreshard"):
        if not ok(name):
            continue
        for p in peers_of(results, rows, name):
            crit(f"{_label(results, name)} per-rank memory <= {_label(results, p)}", name, p, 1.0, what="mem")
    ref = _loss_ref(rows)
    if ref:
        worst = max(abs(r["final_loss"] - rows[ref]["final_loss"]) / abs(rows[ref]["final_loss"])
                    for r in rows.values() if r.get("ok"))
        lines.append(f"| losses after the last step agree (max relative difference to {ref}, tolerance "
                     f"{LOSS_RTOL:g}) | {worst:.1e} | {'met' if worst <= LOSS_RTOL else 'NOT met'} |")
    return lines


def _n_params(c: dict) -> int:
    from zbench.model import ModelSize

    return ModelSize(**c["size"]).n_params


def scaling_table(results, summary, purpose, key_fn, header) -> list[str]:
    cfgs = [c for c in results["configs"] if c["purpose"] in (purpose, "main") and key_fn(c) is not None]
    main = next((c for c in results["configs"] if c["purpose"] == "main"), None)
    if purpose == "size":
        cfgs = [c for c in cfgs if c["world"] == (main["world"] if main else 2) and c["purpose"] != "long-seq"]
    else:
        cfgs = [c for c in cfgs if c["size"]["name"] == (main["size"]["name"] if main else "M")]
    cfgs = sorted({key_fn(c): c for c in cfgs}.values(), key=key_fn)
    if len(cfgs) < 2:
        return []
    names = _order(results, {n for c in cfgs for n, r in summary[c["name"]].items() if r.get("ok")})
    head = " | ".join(f"{header(c)} step ms" for c in cfgs)
    head2 = " | ".join(f"{header(c)} model state MB" for c in cfgs)
    head3 = " | ".join(f"{header(c)} training peak RSS above base MB" for c in cfgs)
    lines = [f"| approach | {head} | {head2} | {head3} |", "|---" * (1 + 3 * len(cfgs)) + "|"]
    for n in names:
        cells = []
        for field in ("step", "mem", "rss"):
            for c in cfgs:
                r = summary[c["name"]].get(n)
                if not r or not r.get("ok"):
                    cells.append("-")
                elif field == "step":
                    cells.append(_ms(r["step_s"]))
                elif field == "mem":
                    cells.append(_mb(r["model_state"]))
                else:
                    cells.append(_mb(r["train_peak_above_base"]))
        lines.append(f"| {_label(results, n)} | " + " | ".join(cells) + " |")
    return lines


def growth_lines(results, summary, purpose) -> list[str]:
    """How step time and model state grow: least-squares slope of log(figure) against log(parameters or ranks)."""
    main = next((c for c in results["configs"] if c["purpose"] == "main"), None)
    if purpose == "size":
        cfgs = [c for c in results["configs"] if c["purpose"] in ("size", "main") and c["world"] == main["world"]]
        x_of = lambda c, r: r["n_params"]  # noqa: E731
        what = "parameters"
    else:
        cfgs = [c for c in results["configs"] if c["purpose"] in ("ranks", "main")
                and c["size"]["name"] == main["size"]["name"]]
        x_of = lambda c, r: c["world"]  # noqa: E731
        what = "ranks"
    out = []
    names = _order(results, {n for c in cfgs for n, r in summary[c["name"]].items() if r.get("ok")})
    for n in names:
        pts = [(x_of(c, summary[c["name"]][n]), summary[c["name"]][n]) for c in cfgs
               if summary[c["name"]].get(n, {}).get("ok")]
        if len(pts) < 2:
            continue
        pts.sort(key=lambda p: p[0])
        st = _slope([(p[0], p[1]["step_s"]) for p in pts])
        ms = _slope([(p[0], p[1]["model_state"]) for p in pts])
        out.append(f"| {_label(results, n)} | {st:+.2f} | {ms:+.2f} |")
    if not out:
        return []
    return [f"| approach | step time ~ {what}^k: k | model state ~ {what}^k: k |", "|---|---|---|"] + out


def _slope(pts) -> float:
    xs = [math.log(x) for x, _ in pts]
    ys = [math.log(y) for _, y in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def issue13_table(results, summary, gpu: dict | None) -> list[str]:
    """Issue 13's figures: step-time ratios against the peers on the main configuration, zero3's communication from
    lightning_zero's own accounting (logical ring volume; the per-op table shows what gloo's algorithms put on the
    wire), zero1's peak RSS against ZeroRedundancyOptimizer, and the one-GPU figures when a ``--gpu`` run exists."""
    main = next((c for c in results["configs"] if c["purpose"] == "main"), None)
    if main is None:
        return []
    rows = summary[main["name"]]
    lines = ["| figure | measured | goal | verdict |", "|---|---|---|---|"]

    def add(text, value, goal, met):
        verdict = "-" if value is None else ("met" if met else "NOT met")
        lines.append(f"| {text} | {'not measured' if value is None else value} | {goal} | {verdict} |")

    def ratio(a, b, key="step_s"):
        if rows.get(a, {}).get("ok") and rows.get(b, {}).get("ok"):
            return rows[a][key] / rows[b][key]
        return None

    for text, a, b, goal in (("zero1 / torch DDP step time", "lz_zero1", "ddp", 1.02),
                             ("zero2 / torch DDP step time", "lz_zero2", "ddp", 1.02),
                             ("zero3 / FSDP2 (reshard) step time", "lz_zero3", "fsdp2", 0.75),
                             ("zero3 / DeepSpeed ZeRO-3 step time", "lz_zero3", "ds_z3", 0.75)):
        r = ratio(a, b)
        add(f"{text}, {main['name']}", None if r is None else f"{r:.3f}", f"<= {goal}", r is not None and r <= goal)
    z3 = rows.get("lz_zero3", {})
    if z3.get("ok") and z3.get("own_comm") and main["world"] > 1:
        psi = z3["n_params"] * 4 * (main["world"] - 1) / main["world"]
        own = sum(z3["own_comm"][0].values()) / psi
        add("zero3 communication per step, own accounting (x Psi(N-1)/N)", f"{own:.2f}", "<= 3.00", own <= 3.005)
    else:
        add("zero3 communication per step, own accounting (x Psi(N-1)/N)", None, "<= 3.00", False)
    r = ratio("lz_zero3", "fsdp2", "wire_bytes")
    add("zero3 bytes written to sockets per step / FSDP2's (reshard)", None if r is None else f"{r:.3f}", "<= 1.0",
        r is not None and r <= 1.0)
    r = ratio("lz_zero1", "torch_zero1", "train_peak_above_base")
    add("zero1 training peak RSS / ZeroRedundancyOptimizer's", None if r is None else f"{r:.3f}", "<= 1.0",
        r is not None and r <= 1.0)
    runs = {g["name"]: g for g in (gpu or {}).get("runs", []) if "error" not in g}
    single = runs.get("single", {}).get("step_ms")
    for stage in (1, 2, 3):
        r = runs[f"zero{stage}"]["step_ms"] / single if single and f"zero{stage}" in runs else None
        add(f"world size 1, zero{stage} / single device (one GPU)", None if r is None else f"{r:.3f}", "<= 1.01",
            r is not None and r <= 1.01)
    r = (runs["zero3_collectives"]["step_ms"] / runs["fsdp2"]["step_ms"]
         if "zero3_collectives" in runs and "fsdp2" in runs else None)
    add("zero3 with real collectives / FSDP2 at world size 1 (one GPU)", None if r is None else f"{r:.3f}", "<= 0.97",
        r is not None and r <= 0.97)
    return lines


def world1_table(results, summary) -> list[str]:
    c = next((c for c in results["configs"] if c["world"] == 1), None)
    if c is None:
        return []
    rows = summary[c["name"]]
    if not rows.get("single", {}).get("ok"):
        return []
    base, lit = rows["single"], rows.get("lit_single", {})
    lines = ["| approach | step ms | vs plain loop | vs Lightning single device | model state MB | "
             "training peak RSS above base MB |", "|---|---|---|---|---|---|"]
    for n in _order(results, [n for n, r in rows.items() if r.get("ok")]):
        r = rows[n]
        lines.append(f"| {_label(results, n)} | {_ms(r['step_s'])} | {_ratio(r['step_s'], base['step_s'])} "
                     f"| {_ratio(r['step_s'], lit['step_s']) if lit.get('ok') else '-'} | {_mb(r['model_state'])} "
                     f"| {_mb(r['train_peak_above_base'])} |")
    return lines


def ops_lines(results, rows) -> list[str]:
    lines = []
    for n in _order(results, [n for n, r in rows.items() if r.get("ok")]):
        r = rows[n]
        ops = ", ".join(f"{op} x{calls} ({nbytes / MB:.1f} MB)" for op, (calls, nbytes) in sorted(r["ops"].items()))
        extra = ""
        if r.get("own_comm"):
            own = r["own_comm"][0]
            extra += "; lightning_zero's own accounting: " + ", ".join(
                f"{op} {b / MB:.1f} MB" for op, b in sorted(own.items()))
        if r.get("own_model_state"):
            own = r["own_model_state"]
            extra += (f"; own model_state_bytes(): {own['total'] / MB:.1f} MB "
                      f"({own['params'] / MB:.1f}/{own['grads'] / MB:.1f}/{own['optimizer'] / MB:.1f})")
        if r.get("detail"):
            top = list(r["detail"].items())[:4]
            extra += "; largest internal tensors: " + ", ".join(f"`{k}` {v / MB:.1f} MB" for k, v in top)
        if r.get("info", {}).get("optimizer"):
            extra += f"; optimizer {r['info']['optimizer']}"
        rounds = ", ".join(_ms(m) + ("*" if i in r["disturbed_rounds"] else "")
                           for i, m in enumerate(r["round_medians"]))
        if r.get("cpu_s") is not None:
            extra += f"; CPU per step, all ranks {_ms(r['cpu_s'])} ms"
        steal = ""
        if any(x is not None for x in r.get("round_steal", [])):
            steal = "; host steal per round " + ", ".join(
                "-" if x is None else f"{100 * x:.1f}%" for x in r["round_steal"])
        lines.append(f"- {_label(results, n)}: per step {ops or 'no collectives'}{extra}; median per round "
                     f"{rounds} ms (* a disturbed round, left out for every approach){steal}; "
                     f"setup {r['setup_s']:.1f} s")
    return lines


def loss_table(results, summary) -> list[str]:
    lines = ["| configuration | reference | reference loss | approaches | max relative difference | all rounds "
             "identical |", "|---|---|---|---|---|---|"]
    for c in results["configs"]:
        rows = {n: r for n, r in summary[c["name"]].items() if r.get("ok")}
        ref = _loss_ref(rows)
        if not ref:
            continue
        worst = max(abs(r["final_loss"] - rows[ref]["final_loss"]) / abs(rows[ref]["final_loss"])
                    for r in rows.values())
        worst_name = max(rows, key=lambda n: abs(rows[n]["final_loss"] - rows[ref]["final_loss"]))
        same = all(r["rounds_agree"] for r in rows.values())
        lines.append(f"| {c['name']} | {ref} | {rows[ref]['final_loss']:.6f} | {len(rows)} | {worst:.1e} "
                     f"({worst_name}) | {'yes' if same else 'no'} |")
    return lines


def render(results: dict, summary: dict, plot_rel: str | None) -> str:
    """The comparison page's text; ``plot_rel``: the plot's link from where it is written."""
    configs = results["configs"]
    main = next((c for c in configs if c["purpose"] == "main"), configs[0])
    m = results["machine"]
    v = m["versions"]
    lines = [
        "# Benchmarks: lightning_zero against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed",
        "",
        "Generated by `benchmarks/compare.py` (do not edit by hand). The other benchmark scripts' tables and the "
        "analysis are on the other pages of this section.",
        "",
        f"Command: `{results['command']}`  ",
        f"Run: {results['started']}, {results['duration_s'] / 60:.1f} min on {m['cpus']} CPUs ({m['cpu']}), "
        f"{m['platform']}; python {v['python']}, torch {v['torch']}, lightning {v.get('lightning')}, "
        f"deepspeed {v.get('deepspeed') or 'not installed'}, lightning_zero {v.get('lightning_zero')}"
        + (f" (commit {v['lightning_zero_commit']})" if v.get("lightning_zero_commit") else "") + ". gloo, "
        "one process per rank, one thread per process.",
        "",
    ]
    if results.get("quick"):
        lines += ["**Quick mode** (`--quick`): a tiny model and one round, to check that everything runs; the "
                  "numbers say nothing about speed.", ""]
    lines += ["Set-up (DeepSpeed, matplotlib) and every option: `benchmarks/README.md`. "
              "How each figure is measured: `benchmarks/zbench/measure.py` (communication and memory), "
              "`benchmarks/zbench/worker.py` (what a step's time covers), `benchmarks/zbench/report.py` (how runs "
              "are pooled), `benchmarks/zbench/plan.py` (alternating order), `benchmarks/zbench/approaches.py` "
              "(each approach's settings).", ""]
    if plot_rel:
        lines += [f"![step time and memory per approach, and their growth with model size and ranks]({plot_rel})", ""]
    elif plot_rel is None:
        lines += ["(plot skipped: matplotlib is not installed in the interpreter that ran the report)", ""]
    if results.get("skipped"):
        lines += ["Skipped approaches: " + "; ".join(f"{_label(results, n)} ({why})"
                                                     for n, why in results["skipped"].items()), ""]
    rows = summary[main["name"]]
    n_params = next((r["n_params"] for r in rows.values() if r.get("ok")), None)
    lines += [f"## Main configuration ({main['name']})", "", _config_line(main, n_params) + ".", ""]
    lines += main_table(results, main, rows) + [""]
    lines += ["### Acceptance criteria (issue 7), on this configuration", ""] + goals_table(results, summary) + [""]
    gpu = _gpu_results()
    lines += ["### Speed and memory goals (issue 13)", ""] + issue13_table(results, summary, gpu) + [""]
    lines += ["### lightning_zero against its like-for-like peers (ratios < 1: lightning_zero is faster / smaller)", ""]
    lines += comparison_table(results, rows) + [""]
    lines += ["Peers are those that shard the same states (stage) without offload; zero1/zero2 are also compared "
              "with DDP. FSDP2 with `reshard_after_forward=False` and lightning_zero zero3 with the same setting keep "
              "parameters gathered from forward to backward (one all-gather less, ZeRO-2-like communication), but hold "
              "sharded parameters between steps like ZeRO-3. DeepSpeed's CPU-offload variants keep optimizer states "
              "and the optimizer step on the host, which on a CPU-only machine is the same memory: they are listed "
              "for completeness, not as memory peers.", ""]
    lines += ["### Collectives per step and internals (rank 0)", ""] + ops_lines(results, rows) + [""]
    for purpose, title, key, head in (
        ("size", "Scaling with model size", lambda c: _n_params(c) if c["purpose"] != "long-seq" else None,
         lambda c: c["size"]["name"]),
        ("ranks", "Scaling with rank count", lambda c: c["world"], lambda c: f"N={c['world']}"),
    ):
        table = scaling_table(results, summary, purpose, key, head)
        if not table:
            continue
        cfgs = [c for c in configs if c["purpose"] == purpose]
        lines += [f"## {title}", ""] + [f"- {c['name']}: " + _config_line(
            c, next((r["n_params"] for r in summary[c["name"]].values() if r.get("ok")), None)) for c in cfgs]
        lines += ["", *table, ""]
        growth = growth_lines(results, summary, purpose)
        if growth:
            lines += ["Growth exponents (least-squares slope on log-log axes; model state ~ ranks^-1 is perfect "
                      "sharding, ~ parameters^1 is linear):", "", *growth, ""]
        if purpose == "ranks":
            w1 = world1_table(results, summary)
            if w1:
                lines += ["### Overhead at world size 1", "", *w1, ""]
            if any(c["world"] > (m["cpus"] or 2) for c in configs):
                lines += [f"Note: N=4 runs 4 single-threaded ranks on {m['cpus']} cores, so the step time includes "
                          "time-slicing; compare approaches at N=4 with each other, not with N=2.", ""]
    for c in configs:
        if c["purpose"] != "long-seq":
            continue
        rows_l = summary[c["name"]]
        n = next((r["n_params"] for r in rows_l.values() if r.get("ok")), None)
        lines += [f"## Long sequence ({c['name']})", "", _config_line(c, n) + ".", ""]
        lines += main_table(results, c, rows_l) + [""]
        lines += comparison_table(results, rows_l) + [""]
    lines += ["## One GPU (`compare.py --gpu`)", ""] + gpu_lines(gpu) + [""]
    lines += ["## Loss agreement", "", *loss_table(results, summary), ""]
    other = [c for c in configs if c["purpose"] != "main"]
    if other and not results.get("quick"):
        lines += ["## All configurations in full", ""]
        for c in other:
            rows_c = summary[c["name"]]
            n = next((r["n_params"] for r in rows_c.values() if r.get("ok")), None)
            lines += [f"### {c['name']}", "", _config_line(c, n) + ".", "", *main_table(results, c, rows_c), ""]
    failed = [r for r in results["runs"] if not r["ok"]]
    if failed:
        lines += ["## Failed runs", ""] + [f"- {r['config']} {r['approach']} round {r['round']}: exit codes "
                                           f"{r['codes']}: `{r.get('error', '')[:300]}`" for r in failed] + [""]
    return "\n".join(lines)


GPU_RESULTS = os.path.join(HERE, "results", "gpu.json")


def _gpu_results() -> dict | None:
    """The last ``compare.py --gpu --results benchmarks/results/gpu.json`` run, if there is one."""
    if not os.path.exists(GPU_RESULTS):
        return None
    with open(GPU_RESULTS) as f:
        return json.load(f)


def gpu_lines(gpu: dict | None) -> list[str]:
    if gpu is None:
        return ["Pending: no GPU was lent for this run. `compare.py --gpu --results benchmarks/results/gpu.json` on a "
                "GPU machine measures a 1.3B GPT (d 2048, 24 layers, seq 2048, vocab 50304, batch 8) at bf16-mixed, "
                "one process per approach, and this section shows its table; its code path runs on the CPU at a tiny "
                "size in tests/integration/test_benchmarks.py."]
    from zbench.gpu import table

    return [gpu["heading"] + f" (`{gpu['command']}`).", "", table(gpu["runs"], gpu.get("peak_tflops", 989.0))]


def image_link(path: str, out_dir: str) -> str:
    """``path`` relative to ``out_dir``; from a page of the docs site, through ``docs/results`` (a link to
    ``benchmarks/results``: the site can show only what lies under docs/)."""
    results, docs = os.path.join(HERE, "results"), os.path.join(os.path.dirname(HERE), "docs")
    path = os.path.abspath(path)
    if os.path.abspath(out_dir).startswith(docs + os.sep) and path.startswith(results + os.sep):
        path = os.path.join(docs, "results", os.path.relpath(path, results))
    return os.path.relpath(path, out_dir)


def write(results: dict, out: str, plot_path: str) -> dict:
    summary = summarize(results)
    plot_rel = None
    try:
        from zbench.plot import plot

        plot(results, summary, plot_path)
        plot_rel = image_link(plot_path, os.path.dirname(os.path.abspath(out)))
    except ImportError:
        plot_rel = None
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(render(results, summary, plot_rel) + "\n")
    return summary


def phase_table(results: dict) -> list[str]:
    """Per approach and configuration: median milliseconds per timed step inside each timed function
    (``compare.py --timers``), on the slowest rank of each step, and calls per step."""
    lines = []
    for cfg in results["configs"]:
        runs = [r for r in results["runs"] if r["config"] == cfg["name"] and r["ok"]
                and any(d.get("phases") for d in r["ranks"])]
        if not runs:
            continue
        names = list(runs[0]["ranks"][0]["phases"][0])
        short = [n.split(":")[-1] for n in names]
        lines += [f"{cfg['name']}: median ms per step inside each function (rank 0), calls per step in brackets", "",
                  "| approach | step ms | " + " | ".join(short) + " |", "|---" * (len(names) + 2) + "|"]
        for name in _order(results, {r["approach"] for r in runs}):
            per_step = [p for r in runs if r["approach"] == name
                        for p in sorted(r["ranks"], key=lambda d: d["rank"])[0]["phases"][cfg["warmup"]:]]
            steps = [t for r in runs if r["approach"] == name
                     for t in sorted(r["ranks"], key=lambda d: d["rank"])[0]["times"][cfg["warmup"]:]]
            cells = []
            for n in names:
                ms = statistics.median(1000 * p[n][0] for p in per_step)
                calls = statistics.median(p[n][1] for p in per_step)
                cells.append(f"{ms:.1f} ({calls:g})" if calls else "-")
            lines.append(f"| {_label(results, name)} | {_ms(statistics.median(steps))} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


if __name__ == "__main__":
    import json
    import sys

    with open(sys.argv[1]) as f:
        print("\n".join(phase_table(json.load(f))))
