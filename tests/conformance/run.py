"""Run Lightning's own DDP tests (``tests/tests_pytorch``, CPU, 2 processes) as they are, then with ZeRO stages 1-3
swapped in for DDP, and write the counts and every failure (README.md beside this file says how to use it).

    python tests/conformance/run.py --lightning-src .conformance/lightning-2.6.6 [--stages ddp 1 2 3]

Steps, each writing under ``--out`` (default ``.conformance/results``):

1. candidates: the test functions of ``tests/tests_pytorch`` whose code (decorators, and module-level helpers they
   name) mentions DDP or 2 devices: a cheap static filter, so that step 2 need not run the whole suite.
2. ddp: the candidates run unchanged; standalone tests (``RunIf(standalone=True)``, which Lightning's CI launches one
   pytest process per test with ``PL_RUN_STANDALONE_TESTS=1``) each in a pytest process of their own, the others in
   one. ``zero_swap.py`` records every Trainer entry point a test calls; the tests selected are those whose root
   process ran ``fit``/``validate``/``test``/``predict`` with Lightning's own ``DDPStrategy`` on the CPU with 2
   processes in total, and that passed in every process.
3. zero1, zero2, zero3: the selected tests again, with ``ZERO_CONFORMANCE_STAGE`` set.
4. summary.md: per stage, of N selected, how many pass; every failure with its first line, the lightning_zero frames
   of its traceback, and its classification from ``classified.json`` (unclassified ones are marked so).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent.parent
#: What a test's code must mention to be a candidate (strategy names, ``DDPStrategy(...)``, 2 devices).
CANDIDATE_TEXT = re.compile(r"ddp|DDPStrategy|devices\s*=\s*2|[\"']devices[\"']\s*:\s*2|num_processes\s*=\s*2")
STAGES = ("ddp", "1", "2", "3")
#: Lightning 2.6.5's tests turn FutureWarnings into errors; torch 2.13 deprecates a function its ``all_gather`` uses
#: (every standalone DDP test failed under DDP on it), so that one warning is let through.
_TORCH_DEPRECATION = r"torch.distributed.nn.functional.all_gather is deprecated"


# ------------------------------------------------------------------------------------------------- 1. candidates


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _candidates_in(path: Path, root: Path) -> list[str]:
    source = path.read_text()
    tree = ast.parse(source)
    helpers = {
        node.name: ast.get_source_segment(source, node) or ""
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith(("test_", "Test"))
    }
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        text = ast.get_source_segment(source, node) or ""
        decorators = "".join(ast.get_source_segment(source, d) or "" for d in getattr(node, "decorator_list", []))
        mentioned = "".join(helpers[name] for name in _names(node) & helpers.keys())
        if CANDIDATE_TEXT.search(decorators + text + mentioned):
            found.append(f"{prefix}::{node.name}")

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            visit(node, str(path.relative_to(root)))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name.startswith("test"):
                    visit(item, f"{path.relative_to(root)}::{node.name}")
    return found


def candidates(src: Path) -> list[str]:
    tests = src / "tests" / "tests_pytorch"
    return [c for path in sorted(tests.rglob("test_*.py")) for c in _candidates_in(path, src)]


# ------------------------------------------------------------------------------------------------------ running


def _pytest(src: Path, args: list[str], log: Path, stage: str, timeout_s: int, extra_env: dict[str, str]) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_CONFORMANCE", "PL_RUN_STANDALONE"))}
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(src / "tests"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["ZERO_CONFORMANCE_LOG"] = str(log)
    env["ZERO_CONFORMANCE_STAGE"] = "" if stage == "ddp" else stage
    command = ["nice", "-n", "15", sys.executable, "-m", "pytest", "-p", "zero_swap", "-p", "no:randomly",
               "-p", "no:cacheprovider", "-q", "--no-header", "--color=no", "--continue-on-collection-errors",
               f"--timeout={timeout_s}", "-W", f"ignore:{_TORCH_DEPRECATION}:FutureWarning", *args]
    with open(log.with_suffix(".out"), "a") as output:
        return subprocess.run(command, cwd=src, env=env, stdout=output, stderr=subprocess.STDOUT).returncode


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def standalone_runnable(src: Path, ids: list[str], out: Path) -> list[str]:
    """The standalone tests among ``ids`` that can run here (no RunIf condition unmet, such as a GPU)."""
    log = out / "collect.jsonl"
    log.unlink(missing_ok=True)
    _pytest(src, ["--collect-only", *ids], log, "ddp", 60,
            {"PL_RUN_STANDALONE_TESTS": "1", "ZERO_CONFORMANCE_COLLECT": "1"})
    return [r["test"] for r in read_log(log) if r["event"] == "collected" and r["standalone"] and not r["skipped"]]


def run_stage(src: Path, stage: str, ids: list[str], standalone: list[str], out: Path, timeout_s: int) -> Path:
    folder = out / ("ddp" if stage == "ddp" else f"zero{stage}")
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "records.jsonl"
    log.unlink(missing_ok=True)
    together = [i for i in ids if i not in standalone]
    if together:
        print(f"[{folder.name}] {len(together)} tests in one process", flush=True)
        _pytest(src, together, log, stage, timeout_s, {})
    for number, test in enumerate(standalone, 1):
        print(f"[{folder.name}] standalone {number}/{len(standalone)}: {test}", flush=True)
        _pytest(src, [test], log, stage, timeout_s, {"PL_RUN_STANDALONE_TESTS": "1"})
    return log


# ---------------------------------------------------------------------------------------------------- outcomes


def outcomes(records: list[dict]) -> dict[str, dict]:
    """Per test: its outcome in the root process, failures in any process, and whether it ran DDP (or the swap) on
    the CPU with 2 processes."""
    tests: dict[str, dict] = defaultdict(lambda: {"outcome": None, "failures": [], "ddp_cpu_2": False, "swaps": [],
                                                  "kept": []})
    for r in records:
        test = tests[r["test"]]
        if r["event"] == "launch" and r["root"] and r["exact_ddp"]:
            test["ddp_cpu_2"] |= r["accelerator"] == "CPUAccelerator" and r["world_size"] == 2
        elif r["event"] == "swap":
            test["swaps"].append(r)
        elif r["event"] == "kept":
            test["kept"].append(r["class"])
        elif r["event"] == "report":
            if r["outcome"] == "failed":
                test["failures"].append(r)
            if r["root"] and (r["when"] == "call" or r["outcome"] != "passed") and test["outcome"] != "failed":
                test["outcome"] = r["outcome"]
    for test in tests.values():
        if test["failures"]:
            test["outcome"] = "failed"
    return dict(tests)


def select(records: list[dict]) -> list[str]:
    """The tests that ran Lightning's DDPStrategy on the CPU with 2 processes and passed in every process."""
    return sorted(t for t, o in outcomes(records).items() if o["ddp_cpu_2"] and o["outcome"] == "passed")


# ----------------------------------------------------------------------------------------------------- summary


_EXCEPTION_LINE = re.compile(r"^\s*([\w.]+(Error|Exception|Exit|Interrupt|Warning)|Failed)\b.*")


def headline(message: str) -> str:
    """The error's first line; for an exception raised in a spawned rank, the rank's exception rather than the
    launcher's ``ProcessRaisedException``."""
    lines = message.splitlines() or [""]
    if "ProcessRaisedException" in lines[0]:
        raised = [line.strip() for line in lines[1:] if _EXCEPTION_LINE.match(line)]
        if raised:
            return raised[-1]
    return lines[0]


def _failure_line(name: str, test: str, result: dict, entry: dict) -> str:
    failures = result.get("failures") or [{}]
    frames = sorted({f for failure in failures for f in failure.get("zero_frames", [])})
    message = failures[0].get("message", result.get("outcome") or "")
    return (f"- {name} `{test}` [{entry.get('class', 'UNCLASSIFIED')}] {headline(message)}"
            + (f" (at {', '.join(frames[-3:])})" if frames else "")
            + (f": {entry['note']}" if entry.get("note") else ""))


def summarize(out: Path, selected: list[str], stages: list[str]) -> str:
    """The table (per stage: of the selected tests, how many ran, passed, failed, and the failures by class), the
    failures of selected tests, and the candidates outside the selection that pass under DDP and fail swapped."""
    classified = json.loads((HERE / "classified.json").read_text())
    under_ddp = outcomes(read_log(out / "ddp" / "records.jsonl"))
    lines = ["| stage | selected (pass under DDP) | ran | pass | fail | our bug | DDP internals | design |",
             "|---|---|---|---|---|---|---|---|"]
    details, outside = [], []
    for stage in (s for s in stages if s != "ddp"):
        name = f"zero{stage}"
        results = outcomes(read_log(out / name / "records.jsonl"))
        ran = [t for t in selected if results.get(t, {}).get("outcome") in ("passed", "failed")]
        failed = [t for t in ran if results[t]["outcome"] == "failed"]
        kinds: dict[str, int] = defaultdict(int)
        for test in failed:
            entry = classified.get(f"{name} {test}") or classified.get(test) or {}
            kinds[entry.get("class", "UNCLASSIFIED")] += 1
            details.append(_failure_line(name, test, results[test], entry))
        lines.append(f"| {name} | {len(selected)} | {len(ran)} | {len(ran) - len(failed)} | {len(failed)} | "
                     f"{kinds['our bug']} | {kinds['DDP internals']} | {kinds['design']} |"
                     + (f" {kinds['UNCLASSIFIED']} unclassified" if kinds["UNCLASSIFIED"] else ""))
        for test, result in results.items():
            if (test not in selected and result["outcome"] == "failed"
                    and under_ddp.get(test, {}).get("outcome") == "passed"):
                entry = classified.get(f"{name} {test}") or classified.get(test) or {}
                outside.append(_failure_line(name, test, result, entry))
    return "\n".join(lines + ["", "Failures of selected tests:", *details, "",
                              "Outside the selection (pass under DDP, no DDP run on the CPU with 2 processes):",
                              *outside]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lightning-src", type=Path, required=True,
                        help="a checkout of Lightning's repository at the installed version (it holds tests/)")
    parser.add_argument("--out", type=Path, default=PROJECT / ".conformance" / "results")
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES,
                        help="'ddp' selects the tests (its result is reused when not given)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    parser.add_argument("--all-candidates", action="store_true",
                        help="run the stages over every candidate, not only the tests the DDP run selected")
    parser.add_argument("-k", dest="only", default=None, help="only the selected tests whose id contains this")
    parser.add_argument("--ids", type=Path, default=None,
                        help="a file of test ids, one a line: every stage runs these instead of the candidates or the "
                             "selection (a re-run of an earlier selection and its failures; ddp selects among them)")
    args = parser.parse_args()
    src, out = args.lightning_src.resolve(), args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    given = [line.strip() for line in args.ids.read_text().splitlines() if line.strip()] if args.ids else None
    if "ddp" in args.stages:
        found = given or candidates(src)
        if not given:
            (out / "candidates.json").write_text(json.dumps(found, indent=1))
        standalone = standalone_runnable(src, found, out)
        print(f"{len(found)} candidate test functions, {len(standalone)} standalone tests runnable here", flush=True)
        log = run_stage(src, "ddp", found, standalone, out, args.timeout)
        selected = select(read_log(log))
        (out / "selected.json").write_text(json.dumps({"tests": selected, "standalone": standalone}, indent=1))
        print(f"selected: {len(selected)} tests pass under DDP on the CPU with 2 processes", flush=True)
    if args.all_candidates or given:  # the stages need not wait for the DDP run: each runs what it would select from
        found = given or json.loads((out / "candidates.json").read_text())
        chosen = {"tests": found, "standalone": standalone_runnable(src, found, out)}
        chosen["tests"] += [t for t in chosen["standalone"] if t not in found]
    else:
        chosen = json.loads((out / "selected.json").read_text())
    selected = [t for t in chosen["tests"] if args.only is None or args.only in t]
    standalone = [t for t in selected if t in chosen["standalone"]]
    for stage in args.stages:
        if stage != "ddp":
            run_stage(src, stage, selected, standalone, out, args.timeout)
    if not (out / "selected.json").exists():
        return
    summary = summarize(out, json.loads((out / "selected.json").read_text())["tests"], list(STAGES))
    (out / "summary.md").write_text(summary)
    print(summary)


if __name__ == "__main__":
    main()
