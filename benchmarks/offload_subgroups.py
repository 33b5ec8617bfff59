#!/usr/bin/env python
"""Disk offload's step against its sub-group size: where a smaller sub-group starts to cost step time (the floor of
``offload/sizing.py``'s choice, ``MIN_SUBGROUP_MB``), and what a third resident buffer buys.

One 2-rank job (forked ranks, gloo, one thread each) trains a GPT with ``zero3_offload_disk`` (fp32, AdamW, files
under ``--workdir``) once per setting, in the same processes: each setting is a fresh fit of ``--steps`` steps. Per
setting it records, on every rank, the time from ``on_before_optimizer_step`` to the end of the batch (the offloaded
step: reading each sub-group's masters, moments, rows and gradients, the fused Adam, writing them back), steps 2 and on
(the first creates the optimizer states), wall-clock and CPU time (the process's, its I/O thread's included: what
each sub-group costs beyond its reads and writes), the sub-group count, and the rank's resident buffers during a step
(``DiskOffload.step_buffer_bytes``). The
settings run in rounds, each round in a shuffled order, so that a disturbance of the shared machine does not fall on
one setting only; the report gives each setting's median over rounds and steps, the slower rank's.

    python benchmarks/offload_subgroups.py                       # ~10 min on 2 cores
    python benchmarks/offload_subgroups.py --report-only benchmarks/results/offload_subgroups.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "offload_subgroups.json")
#: 16 layers of width 512 (50M parameters): shards of at most 2 MiB of masters per rank, so that a sub-group of a few
#: MiB holds few of them, and the sub-group count follows its size down to 2 MiB.
MODEL = dict(vocab_size=1024, n_layer=16, n_head=8, d_model=512, seq_len=64)
BATCH = 2
#: (sub-group MiB, resident sub-groups)
SETTINGS = [(1, 2), (2, 2), (4, 2), (8, 2), (16, 2), (32, 2), (64, 2), (8, 3), (32, 3)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=os.path.join(ROOT, "bench_work", "offload_subgroups"))
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--report-only", default="")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.report_only) as f:
            print(render(json.load(f)))
        return 0
    sys.path.insert(0, ROOT)
    from tests.harness import run_on_ranks

    os.makedirs(args.workdir, exist_ok=True)
    rounds = [random.Random(r).sample(SETTINGS, len(SETTINGS)) for r in range(args.rounds)]
    started = time.strftime("%Y-%m-%d %H:%M")
    per_rank = run_on_ranks(lambda rank, world: _job(rounds, args.steps, args.workdir), 2, timeout_s=3600)
    from memory_phases import git_commit

    results = dict(command=" ".join(["python", os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]),
                   started=started, commit=git_commit(), model=MODEL, batch=BATCH, steps=args.steps, rounds=rounds,
                   ranks=per_rank, loadavg=os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    with open(args.results, "w") as f:
        json.dump(results, f, indent=1)
    print(render(results))
    return 0


def _job(rounds: list, steps: int, workdir: str) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy
    from lightning_zero.models import GPTConfig, LanguageModel
    from tests.models import make_trainer

    config = GPTConfig(**MODEL)

    class StepTimes(pl.Callback):
        reads_parameters = False

        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.cpu: list[float] = []
            self.groups = 0
            self.buffers = 0
            self._start = (0.0, 0.0)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self._start = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.seconds.append(time.perf_counter() - self._start[0])
            self.cpu.append(time.process_time() - self._start[1])
            offload = trainer.strategy.runtime.offload
            self.groups = len(list(offload.groups(offload.shards)))
            self.buffers = max(self.buffers, trainer.strategy.runtime.offload.step_buffer_bytes)

    tokens = torch.randint(0, config.vocab_size, (BATCH * 2 * steps, config.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    out: dict[str, list] = {}
    for settings in rounds:
        for size, resident in settings:
            torch.manual_seed(0)
            probe = StepTimes()
            with tempfile.TemporaryDirectory(dir=workdir) as offload_dir:
                strategy = ZeroStrategy(stage=3, units=["Block"], offload_optimizer="disk", offload_params="disk",
                                        offload_dir=offload_dir, offload_subgroup_mb=float(size),
                                        offload_resident_subgroups=resident)
                make_trainer(strategy, 2, max_steps=steps, callbacks=[probe]).fit(
                    LanguageModel(config, lr=1e-4, warmup_steps=0), train_dataloaders=data)
            out.setdefault(f"{size}x{resident}", []).append(dict(seconds=probe.seconds[1:], cpu=probe.cpu[1:],
                                                                 groups=probe.groups, buffers=probe.buffers))
    return out


def render(results: dict) -> str:
    m = results["model"]
    ranks = results["ranks"]
    lines = [
        f"GPTConfig(vocab_size={m['vocab_size']}, n_layer={m['n_layer']}, n_head={m['n_head']}, "
        f"d_model={m['d_model']}, seq_len={m['seq_len']}), fp32, AdamW, zero3_offload_disk, 2 CPU ranks (forked, "
        f"gloo), {results['batch']} sequences a rank and step, {results['steps']} steps a fit (the first not "
        f"timed), {len(results['rounds'])} rounds of every setting in shuffled orders; {results['started']}, commit "
        f"{results.get('commit')}, load "
        f"average {results['loadavg'][0]:.1f} at the end. Command: `{results['command']}`.", "",
        "| sub-group (MiB) | resident | sub-groups | offloaded step, median (s) | against the best | CPU time (s) | "
        "against the best | resident buffers per rank (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    timed_cpu = "cpu" in next(iter(ranks[0].values()))[0]  # runs before the CPU time was recorded have none
    wall, cpu = _medians(ranks, "seconds"), _medians(ranks, "cpu") if timed_cpu else {}
    for key in sorted(wall, key=lambda k: tuple(int(x) for x in k.split("x"))[::-1]):
        size, resident = key.split("x")
        buffers = max(r["buffers"] for rank in ranks for r in rank[key]) / 2**20
        groups = ranks[0][key][0].get("groups", "-")
        cpu_cells = f"{cpu[key]:.2f} | {cpu[key] / min(cpu.values()):.2f}x" if cpu else "- | -"
        lines.append(f"| {size} | {resident} | {groups} | {wall[key]:.2f} | {wall[key] / min(wall.values()):.2f}x | "
                     f"{cpu_cells} | {buffers:.0f} |")
    return "\n".join(lines) + "\n"


def _medians(ranks: list, kind: str) -> dict[str, float]:
    """Per setting, the median over rounds and steps of the slower rank's ``kind`` (wall or CPU seconds)."""
    return {key: statistics.median(max(a, b) for r0, r1 in zip(ranks[0][key], ranks[1][key])
                                   for a, b in zip(r0[kind], r1[kind])) for key in ranks[0]}


if __name__ == "__main__":
    sys.exit(main())
