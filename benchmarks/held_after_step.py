#!/usr/bin/env python
"""What a rank holds after a step, against ZeRO's formulas, and what bounding the step's buffers costs in time.

A Hugging Face GPT-2 built from its config (tied 1024-row embedding, 4 layers of width 256: 3.68M parameters, a unit
is a fifth of it) trains on 2 forked CPU ranks (gloo, one thread each) under zero3 in fp32 and zero1 and zero2 in
bf16-mixed; after every step every tensor alive in the process is counted (the garbage collector's, each storage
once, less the data set), with a callback that reads no parameters, so that the gathers zero1 and zero2 leave in
flight to the next forward count too. Beside each, the same run as before issue 38: zero3's unit buffer pool kept
between steps (up to two units' buffers), zero1/zero2's gathers left in flight whatever their buffers hold
(``overlap_gather=True``; one 25 MiB bucket holds this whole model); both with ``lean_memory=True``, which the
defaults take where the model states are over an eighth of the rank's memory budget (memory_policy.py; on a roomy
machine this model gets the fast side, which keeps those buffers as "before" does). Then the step times of both, on this
model and on the 10.6M GPT of BENCHMARKS.md's M-2 (vocabulary 8192, 8 layers of width 256, whose two buckets of 25 MiB
are more than its 42 MB of parameters), in rounds alternating the two (the median of each, steps 3 and on, the slower
rank's), wall-clock and CPU time (the process's, all its threads). Wall-clock timings on this shared 2-core machine are
noisy: read them against the rounds' spread, and beside the CPU time, which a busy machine disturbs less.

    python benchmarks/held_after_step.py                 # ~5 min on 2 cores
    python benchmarks/held_after_step.py --report-only benchmarks/results/held_after_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "held_after_step.json")
GPT2 = dict(vocab_size=1024, n_layer=4, n_embd=256, n_head=4, n_positions=1024)
M2 = dict(vocab_size=8192, n_layer=8, n_head=8, d_model=256, seq_len=128)
SEQ, BATCH = 32, 4
#: name: (stage, precision)
RUNS = {"zero3": (3, "32-true"), "zero1": (1, "bf16-mixed"), "zero2": (2, "bf16-mixed")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timed", default="", help="comma list of MODEL/RUN to time (default: every one), e.g. "
                    "gpt2/zero3,M-2/zero3")
    ap.add_argument("--report-only", default="")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.report_only) as f:
            print(render(json.load(f)))
        return 0
    sys.path.insert(0, ROOT)
    from tests.harness import run_on_ranks

    started = time.strftime("%Y-%m-%d %H:%M")
    timed = [tuple(t.split("/")) for t in args.timed.split(",") if t]
    ranks = run_on_ranks(lambda rank, world: _job(args.rounds, args.steps, timed), 2, timeout_s=3600)
    from memory_phases import git_commit

    results = dict(command=" ".join(["python", os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]),
                   started=started, commit=git_commit(), loadavg=os.getloadavg(), steps=args.steps, ranks=ranks)
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    with open(args.results, "w") as f:
        json.dump(results, f, indent=1)
    print(render(results))
    return 0


def _job(rounds: int, steps: int, timed: list[tuple[str, str]]) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy
    from lightning_zero.models import GPTConfig, LanguageModel
    from lightning_zero.models.hf import HFModelConfig
    from tests.live_tensors import live_tensor_bytes
    from tests.models import make_trainer

    class Probe(pl.Callback):
        reads_parameters = False

        def __init__(self, count: bool, before: bool) -> None:
            self.count, self.before = count, before
            self.live: list[int] = []
            self.seconds: list[float] = []
            self.cpu: list[float] = []
            self._start = (0.0, 0.0)

        def on_train_start(self, trainer, pl_module) -> None:
            parameters = trainer.strategy.runtime.parameters
            if self.before and hasattr(parameters, "units"):  # zero3 before: the pool kept between steps
                parameters.pool.clear = lambda: None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._start = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.seconds.append(time.perf_counter() - self._start[0])
            self.cpu.append(time.process_time() - self._start[1])
            if self.count:
                del outputs
                self.live.append(live_tensor_bytes())

    def fit(name: str, model_config, before: bool, count: bool, n_steps: int) -> tuple[Probe, int]:
        stage, precision = RUNS[name]
        vocab = getattr(model_config, "vocab_size", GPT2["vocab_size"])
        seq = getattr(model_config, "seq_len", SEQ)
        tokens = torch.randint(0, vocab, (BATCH * 2 * n_steps, seq + 1), generator=torch.Generator().manual_seed(1))
        data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
        torch.manual_seed(0)
        model = LanguageModel(model_config, lr=1e-3, warmup_steps=0)
        probe = Probe(count, before)
        overlap = {"overlap_gather": True} if before and stage < 3 else {}
        baseline = live_tensor_bytes()
        # lean (the defaults where the model states are a large share of the budget), before issue 38 or after
        trainer = make_trainer(ZeroStrategy(stage=stage, lean_memory=True, **overlap), 2, max_steps=n_steps,
                               callbacks=[probe], precision=precision)
        trainer.fit(model, train_dataloaders=data)
        probe.live = [b - baseline for b in probe.live]
        return probe, model.num_parameters

    gpt2 = HFModelConfig("gpt2", GPT2)
    out: dict = {"held": {}, "seconds": {}, "cpu": {}}
    for name in RUNS:
        for before in (True, False):
            probe, psi = fit(name, gpt2, before, count=True, n_steps=3)
            out["held"][f"{name}/{'before' if before else 'after'}"] = dict(live=probe.live, psi=psi)
    models = {"gpt2": gpt2, "M-2": GPTConfig(**M2)}
    timed = timed or [(model_name, name) for model_name in models for name in RUNS]
    for _ in range(rounds):
        for model_name, name in timed:
            for before in (False, True):
                probe, _ = fit(name, models[model_name], before, count=False, n_steps=steps)
                key = f"{model_name}/{name}/{'before' if before else 'after'}"
                out["seconds"].setdefault(key, []).append(probe.seconds[2:])
                out["cpu"].setdefault(key, []).append(probe.cpu[2:])
    return out


def formula(name: str, psi: int, n: int = 2) -> float:
    """ZeRO's model-state bytes per rank (Adam): zero3 fp32 16Ψ/N; zero1 mixed 4Ψ + 12Ψ/N; zero2 mixed 2Ψ + 14Ψ/N."""
    return {"zero3": 16 * psi / n, "zero1": 4 * psi + 12 * psi / n, "zero2": 2 * psi + 14 * psi / n}[name]


def render(results: dict) -> str:
    ranks = results["ranks"]
    lines = [
        f"Held after each of 3 steps: HF GPT-2 from its config ({GPT2}), {BATCH} x {SEQ} tokens a rank and step, 2 "
        f"forked CPU ranks; every tensor alive in the process, less the data set, the larger rank. Step times: "
        f"{len(next(iter(ranks[0]['seconds'].values())))} rounds of {results['steps']} steps (median of steps 3 and "
        f"on, the slower rank). {results['started']}, commit {results.get('commit')}, load average "
        f"{results['loadavg'][0]:.1f} at the end. Command: "
        f"`{results['command']}`.", "",
        "| run | formula | held / formula, before | after |", "|---|---|---|---|",
    ]
    labels = {"zero3": "zero3, fp32: 16Ψ/N", "zero1": "zero1, bf16-mixed: 4Ψ + 12Ψ/N",
              "zero2": "zero2, bf16-mixed: 2Ψ + 14Ψ/N"}
    for name in RUNS:
        ratios = []
        for when in ("before", "after"):
            held = [r["held"][f"{name}/{when}"] for r in ranks]
            ratios.append(max(max(h["live"]) / formula(name, h["psi"]) for h in held))
        lines.append(f"| {name} | {labels[name]} | {ratios[0]:.3f} | {ratios[1]:.3f} |")
    lines += ["", "| model | run | step before (s) | step after (s) | after / before (rounds) | CPU time per step, "
              "after / before (rounds) |", "|---|---|---|---|---|---|"]
    for key in [k for k in ranks[0]["seconds"] if k.endswith("/after")]:
        model, name, _ = key.split("/")
        wall, cpu = (_per_round(ranks, kind, model, name) for kind in ("seconds", "cpu"))
        lines.append(f"| {model} | {name} | {statistics.median(wall['before']):.3f} | "
                     f"{statistics.median(wall['after']):.3f} | {_ratio(wall)} | {_ratio(cpu)} |")
    return "\n".join(lines) + "\n"


def _per_round(ranks: list, kind: str, model: str, name: str) -> dict[str, list[float]]:
    """Each round's median step of ``kind`` (wall or CPU seconds), the slower rank's, before and after."""
    per_round = {}
    for when in ("before", "after"):
        rounds = zip(*(r[kind][f"{model}/{name}/{when}"] for r in ranks))
        per_round[when] = [statistics.median(max(a, b) for a, b in zip(*pair)) for pair in rounds]
    return per_round


def _ratio(per_round: dict[str, list[float]]) -> str:
    ratio = statistics.median(per_round["after"]) / statistics.median(per_round["before"])
    spread = [a / b for a, b in zip(per_round["after"], per_round["before"])]
    return f"{ratio:.2f}x ({min(spread):.2f}-{max(spread):.2f}x)"


if __name__ == "__main__":
    sys.exit(main())
