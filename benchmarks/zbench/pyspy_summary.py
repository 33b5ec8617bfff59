"""Summarize py-spy raw (collapsed-stack) profiles: where a rank's Python thread spends its time.

    python benchmarks/zbench/pyspy_summary.py bench_work/compare/full/M-2.lz_zero3.r0.rank0.pyspy.txt [--within fit]

Prints the share of samples per function, inclusive (the function or anything it calls is running) and self (the
function itself is the innermost Python frame; time in C++ kernels called from it counts as its self time), over the
samples whose stack contains ``--within`` (default: the benchmark's step loop, ``run_loop`` or ``fit``).
"""

from __future__ import annotations

import argparse
import collections
import re

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    path = m.group("file")
    for marker in ("site-packages/", "/work/main/", "benchmarks/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{m.group('func')} ({path}:{m.group('line')})" if m.group("line") else f"{m.group('func')} ({path})"


def _func_key(frame: str) -> str:
    """The function, without the line being executed, for inclusive totals."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    return _short(f"{m.group('func')} ({m.group('file')})")


def summarize(paths: list[str], within: tuple[str, ...], top: int = 30, exclude: tuple[str, ...] = ()) -> str:
    inclusive: collections.Counter = collections.Counter()
    self_time: collections.Counter = collections.Counter()
    total = 0
    for path in paths:
        with open(path) as f:
            for line in f:
                stack, _, count = line.rstrip("\n").rpartition(" ")
                if not stack:
                    continue
                frames = stack.split(";")
                if within and not any(any(w in fr for w in within) for fr in frames):
                    continue
                if exclude and any(any(x in fr for x in exclude) for fr in frames):
                    continue
                n = int(count)
                total += n
                self_time[_short(frames[-1])] += n
                for key in {_func_key(fr) for fr in frames}:
                    inclusive[key] += n
    if not total:
        return "no samples"
    out = [f"{total} samples in {len(paths)} file(s), within {within}, excluding {exclude}", "",
           "inclusive %  function"]
    out += [f"{100 * n / total:10.1f}  {k}" for k, n in inclusive.most_common(top)]
    out += ["", "self %  innermost Python frame (line)"]
    out += [f"{100 * n / total:6.1f}  {k}" for k, n in self_time.most_common(top)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--within", default="run_loop,fit", help="comma list: keep stacks containing one of these")
    ap.add_argument("--exclude", default="held_tensor_bytes,_start_profiler,_stop_profiler",
                    help="comma list: drop stacks containing one of these (the benchmark's own measurements)")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    print(summarize(args.paths, tuple(w for w in args.within.split(",") if w), args.top,
                    tuple(x for x in args.exclude.split(",") if x)))


if __name__ == "__main__":
    main()
