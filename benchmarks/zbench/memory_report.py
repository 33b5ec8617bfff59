"""The whole-run memory report of ``benchmarks/memory_phases.py``: the measured peak of every phase beside the memory
model's formula for it (``lightning_zero.estimate.peak_estimate``), the findings (a lightning_zero phase more than
10% over its formula), and the tables that go into BENCHMARKS.md (``report.memory_section``)."""

from __future__ import annotations

import os

#: The memory model's option each approach is measured against (peers: the ZeRO stage they implement).
OPTIONS = {"lit_ddp": "ddp", "fsdp2": "zero3", "ds_z1": "zero1", "ds_z2": "zero2", "ds_z3": "zero3"}
PHASES = ("import_build", "setup", "first_step", "steady_step", "checkpoint_save", "teardown", "load_resume")
#: A phase this far over its formula is a finding.
TOLERANCE = 1.10


def option_of(approach: str) -> str:
    return OPTIONS.get(approach, approach[3:] if approach.startswith("lz_") else approach)


def predictions(spec: dict, world: int, python: str | None = None) -> dict:
    """The measured step of the benchmark model and, per option, the formula of every phase (bytes per rank)."""
    from dataclasses import asdict

    from lightning_zero import config, estimate
    from lightning_zero.models import GPTConfig
    from lightning_zero.step_measure import measure_step

    model = GPTConfig(**spec["model"])
    measure = measure_step(model, model.vocab_size, model.seq_len, units=("Block",))
    offload = config.OffloadConfig(offload_subgroup_mb=spec["subgroup_mb"])
    formulas = {}
    for option in estimate.OPTIONS:
        peak = estimate.peak_estimate(option, model.num_parameters, world, measure, spec["batch"], offload=offload,
                                      eager=spec["build"] == "eager", bucket_mb=25.0)
        formulas[option] = dict(phases=peak.phases, terms=peak.terms, peak=peak.peak, peak_phase=peak.peak_phase)
    return dict(measure=asdict(measure), params=model.num_parameters, formulas=formulas)


def rows(results: dict) -> list[dict]:
    """Per approach: per phase the largest rank's peak and split, the formula and their ratio."""
    out = []
    formulas = results["estimate"]["formulas"]
    for name, job in results["jobs"].items():
        row = dict(name=name, option=option_of(name), ok=job["ok"], error=job.get("error"),
                   cgroup_peak=job.get("cgroup_peak"), phases={})
        formula = formulas.get(row["option"])
        if job["ok"]:
            for phase in PHASES:
                figures = [r["phases"][phase] for r in job["ranks"] if phase in r["phases"]]
                if not figures:
                    continue
                worst = max(figures, key=lambda f: f["hwm"])
                expected = formula["phases"][phase] if formula else None
                row["phases"][phase] = dict(hwm=worst["hwm"], anon=worst["anon"], file=worst["file"],
                                            formula=expected, ratio=worst["hwm"] / expected if expected else None)
            # The largest phase: ru_maxrss cannot serve, since resetting VmHWM (clear_refs) resets it too.
            row["peak"] = max(f["hwm"] for f in row["phases"].values())
            row["predicted"] = formula["peak"] if formula else None
        out.append(row)
    return out


def findings(table: list[dict]) -> list[str]:
    """Every lightning_zero phase more than ``TOLERANCE`` over its formula, worst first."""
    found = []
    for row in table:
        if not row["name"].startswith("lz_"):
            continue
        for phase, f in row["phases"].items():
            if f["ratio"] is not None and f["ratio"] > TOLERANCE:
                found.append((f["ratio"], f"{row['option']} {phase}: {_gib(f['hwm'])} GiB measured against "
                                          f"{_gib(f['formula'])} GiB by formula ({f['ratio']:.2f}x; anonymous "
                                          f"{_gib(f['anon'])}, file-mapped {_gib(f['file'])})"))
        if row.get("predicted") and row["peak"] > TOLERANCE * row["predicted"]:
            found.append((row["peak"] / row["predicted"], f"{row['option']} whole run: peak {_gib(row['peak'])} GiB "
                                                          f"per rank against the estimate's {_gib(row['predicted'])}"))
    return [text for _, text in sorted(found, reverse=True)]


def render(results: dict) -> str:
    table = rows(results)
    spec, est = results["spec"], results["estimate"]
    m = est["measure"]
    model = spec["model"]
    head = (f"Model {results['model_name']} ({est['params'] / 1e6:.1f}M parameters: {model['n_layer']} layers, width "
            f"{model['d_model']}, vocabulary {model['vocab_size']}), fp32, AdamW, {results['world']} ranks on this "
            f"machine's CPUs, {spec['batch']} x {model['seq_len']} tokens per rank and step, model built "
            f"{'eagerly in __init__' if spec['build'] == 'eager' else 'in configure_model'}, {spec['steps']} steps "
            f"then a resume in fresh processes; disk offload sub-groups of {spec['subgroup_mb']:g} MiB. Commit "
            f"{results.get('commit')}, {results['started']}. Command: `{results['command']}`")
    measured = (f"Measured step (`estimate --measure`): baseline {_gib(m['baseline'])} GiB, activations "
                f"{_mib(m['activation_per_sample'])} MiB per sequence + {_mib(m['activation_fixed'])} MiB, largest "
                f"unit {m['unit_elements'] / 1e6:.2f}M elements.")
    if results.get("estimate_note"):
        measured += f" The formulas: {results['estimate_note']}."
    lines = [head, "", measured, "",
             "Peak resident memory per rank (the larger rank), GiB: measured / formula (ratio). Whole run: the "
             "largest phase per rank and the estimate's predicted peak; whole job: every rank and the page cache "
             "(cgroup).", "",
             "| approach | " + " | ".join(p.replace("_", " ") for p in PHASES) + " | whole run / estimate | whole job |",
             "|---" * (len(PHASES) + 3) + "|"]
    for row in table:
        if not row["ok"]:
            lines.append(f"| {row['name']} | " + " | ".join(["-"] * len(PHASES)) +
                         f" | {'skipped' if 'not installed' in (row['error'] or '') else 'failed'} | - |")
            continue
        cells = []
        for phase in PHASES:
            f = row["phases"].get(phase)
            cells.append("-" if f is None else f"{_gib(f['hwm'])} / {_gib(f['formula'])} ({f['ratio']:.2f})"
                         + (" **!**" if row["name"].startswith("lz_") and f["ratio"] > TOLERANCE else ""))
        whole = f"{_gib(row['peak'])} / {_gib(row['predicted'])} ({row['peak'] / row['predicted']:.2f})"
        lines.append(f"| {_label(row)} | " + " | ".join(cells) + f" | {whole} | {_gib(row['cgroup_peak'])} |")
    lines += ["", "The same peaks split into anonymous and file-mapped memory (GiB, anon + file, each the largest "
              "sampled in the phase):", "",
              "| approach | " + " | ".join(p.replace("_", " ") for p in PHASES) + " |",
              "|---" * (len(PHASES) + 1) + "|"]
    for row in table:
        if row["ok"]:
            lines.append(f"| {_label(row)} | " + " | ".join(
                f"{_gib(f['anon'])} + {_gib(f['file'])}" if (f := row["phases"].get(p)) else "-" for p in PHASES) + " |")
    terms = est["formulas"]
    lines += ["", "Formula terms per option (MiB): baseline, eager model, model states in memory, buckets, gathered "
              "units, stage 3's reductions in flight, activations, optimizer workspace; a step adds them up, except "
              "that stage 3's holds the larger of activations + reductions and workspace "
              "(lightning_zero/peak_model.py, [Note: the peak of a run], [Note: where stage 3's step peaks]):", "",
              "| option | " + " | ".join(next(iter(terms.values()))["terms"]) + " |",
              "|---" * (len(next(iter(terms.values()))["terms"]) + 1) + "|"]
    for option in dict.fromkeys(row["option"] for row in table):
        if option in terms:
            lines.append(f"| {option} | " + " | ".join(_mib(v) for v in terms[option]["terms"].values()) + " |")
    found = findings(table)
    lines += ["", f"Findings (a lightning_zero phase more than {TOLERANCE - 1:.0%} over its formula): "
              + ("none." if not found else "")]
    lines += [f"- {text}" for text in found]
    return "\n".join(lines) + "\n"


def write(results: dict, out: str) -> None:
    text = render(results)
    print(text, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)


def _label(row: dict) -> str:
    return row["name"][3:] if row["name"].startswith("lz_") else {
        "lit_ddp": "DDP (Lightning)", "fsdp2": "FSDP2", "ds_z1": "DeepSpeed ZeRO-1", "ds_z2": "DeepSpeed ZeRO-2",
        "ds_z3": "DeepSpeed ZeRO-3"}.get(row["name"], row["name"])


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def _mib(n) -> str:
    return f"{n / 2**20:.0f}"
