"""Peak resident memory per rank of in-memory zero3 against disk offload (``zero3_offload_disk``), same script.

Each variant is one fresh 2-rank run (Lightning's ``popen`` launcher re-runs this script for rank 1), a GPT built on
the meta device and materialized shard by shard, random tokens, AdamW. Per rank, a probe resets the kernel's
high-water mark (``/proc/self/clear_refs`` = 5) when training starts and reads ``VmHWM`` from ``/proc/self/status``
after the last step, so set-up and the end-of-fit gather of the full model are not in the training peak; it also
samples ``RssAnon``, ``RssFile`` and ``RssShmem`` every 20 ms, because the memory-mapped offload files count in RSS
as file pages while they are resident (disk offload releases each sub-group's pages after its step, so they are part
of what is measured, not hidden). The process's whole-life peak (``ru_maxrss``, set-up included) is reported too.

glibc's allocator matters: it raises its mmap threshold up to 32 MiB after the first large free, so later tensors of
a few MiB come from its heap, which keeps their pages after they are freed, and RSS then counts memory no tensor
holds. Disk offload returns what it frees to the system (``lightning_zero.memory.give_back_freed_memory``, after set-up and after the first
step has moved the optimizer's states into files); ``--fixed-mmap-threshold`` runs both variants with the threshold
fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_=65536``), where RSS is closer to what the tensors hold.

    python benchmarks/offload_rss.py                       # 340M parameters, 4 steps each: ~5 minutes on 2 cores
    python benchmarks/offload_rss.py --layers 2 --d-model 256 --steps 2   # a smoke run

Prints a Markdown table and writes every figure to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

VARIANTS = {
    "zero3": {},
    "zero3_offload_disk": {"offload_optimizer": "disk", "offload_params": "disk"},
}


def _status() -> dict[str, int]:
    """Fields of /proc/self/status in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _probe_class():
    import lightning.pytorch as pl

    class RSSProbe(pl.Callback):
        """Peak RSS of the training steps (see the module docstring) and the step times."""

        def __init__(self) -> None:
            self.samples: list[tuple[int, int, int]] = []
            self.step_times: list[float] = []
            self._stop = threading.Event()
            self._thread: threading.Thread | None = None
            self._started = 0.0

        def _sample(self) -> None:
            while not self._stop.wait(0.02):
                s = _status()
                self.samples.append((s.get("RssAnon", 0), s.get("RssFile", 0), s.get("RssShmem", 0)))

        def on_train_start(self, trainer, pl_module) -> None:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.start_rss = _status()["VmRSS"]
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.step_times.append(time.perf_counter() - self._started)

        def on_train_end(self, trainer, pl_module) -> None:
            self.hwm = _status()["VmHWM"]
            self._stop.set()
            self._thread.join()
            self.held = trainer.strategy.model_state_bytes()

    return RSSProbe


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy
    from lightning_zero.models import GPTConfig, LanguageModel

    torch.set_num_threads(1)  # two ranks on two cores
    config = GPTConfig(vocab_size=256, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                       seq_len=args.seq, dropout=0.0)
    model = LanguageModel(config, lr=1e-4, warmup_steps=0)
    tokens = torch.randint(0, 256, (args.batch * 2 * (args.steps + 1), args.seq + 1),
                           generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    options = dict(VARIANTS[args.worker])
    if options:
        options.update(offload_dir=args.offload_dir, offload_subgroup_mb=args.subgroup_mb)
    probe = _probe_class()()
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=3, units=["Block"], start_method="popen", **options),
        accelerator="cpu", devices=2, precision=args.precision, max_steps=args.steps, callbacks=[probe],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=data)
    anon, file, shmem = (max(s[i] for s in probe.samples) if probe.samples else 0 for i in range(3))
    record = {
        "rank": trainer.global_rank, "variant": args.worker, "params": model.num_parameters,
        "hwm_train": probe.hwm, "rss_at_train_start": probe.start_rss,
        "max_rss_anon": anon, "max_rss_file": file, "max_rss_shmem": shmem,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_times": probe.step_times,
        "held": {"device": probe.held.device, "host": probe.held.host, "disk": probe.held.disk},
    }
    Path(args.records, f"{args.worker}-rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=1536)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--subgroup-mb", type=float, default=8.0, help="offload_subgroup_mb of the disk variant")
    parser.add_argument("--offload-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--out", default=None, help="JSON file for every figure")
    parser.add_argument("--fixed-mmap-threshold", action="store_true", help="MALLOC_MMAP_THRESHOLD_=65536 for both")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--records", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="offload_rss-") as work:
        records = {}
        for variant in VARIANTS:
            directory = Path(work, variant)
            directory.mkdir()
            command = [sys.executable, __file__, *sys.argv[1:], "--worker", variant, "--records", str(directory),
                       "--offload-dir", args.offload_dir or work]
            started = time.perf_counter()
            env = {**os.environ, "PYTHONWARNINGS": "ignore"}
            if args.fixed_mmap_threshold:
                env["MALLOC_MMAP_THRESHOLD_"] = "65536"
            subprocess.run(command, check=True, env=env)
            records[variant] = {
                "wall_s": time.perf_counter() - started,
                "ranks": [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))],
            }
        print(report(args, records))
        if args.out:
            Path(args.out).write_text(json.dumps({"args": vars(args), "records": records}, indent=2))


def report(args: argparse.Namespace, records: dict) -> str:
    import statistics

    def gib(n: float) -> str:
        return f"{n / 2**30:.2f}"

    base, disk = records["zero3"]["ranks"], records["zero3_offload_disk"]["ranks"]
    params = base[0]["params"]

    def step_time(ranks: list[dict]) -> float:  # median over the steps after the first, slowest rank
        return max(statistics.median(r["step_times"][1:] or r["step_times"]) for r in ranks)

    lines = [
        f"GPT of {params / 1e6:.1f}M parameters ({args.layers} layers, width {args.d_model}), {args.precision}, "
        f"2 ranks, {args.batch} x {args.seq} tokens per rank and step, {args.steps} steps, AdamW; disk sub-groups "
        f"of {args.subgroup_mb:g} MiB; glibc's mmap threshold "
        + ("fixed at 64 KiB" if args.fixed_mmap_threshold else "dynamic (its default)"),
        "",
        "| variant | rank | peak RSS, training (GiB) | RssAnon max | RssFile max | peak RSS, whole process | "
        "model states device / host / disk (GiB) | median step (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, ranks in (("zero3", base), ("zero3_offload_disk", disk)):
        for r in ranks:
            held = r["held"]
            lines.append(
                f"| {variant} | {r['rank']} | {gib(r['hwm_train'])} | {gib(r['max_rss_anon'])} | "
                f"{gib(r['max_rss_file'])} | {gib(r['ru_maxrss'])} | {gib(held['device'])} / {gib(held['host'])} / "
                f"{gib(held['disk'])} | {statistics.median(r['step_times'][1:] or r['step_times']):.2f} |"
            )
    peak_ratio = max(r["hwm_train"] for r in disk) / max(r["hwm_train"] for r in base)
    whole_ratio = max(r["ru_maxrss"] for r in disk) / max(r["ru_maxrss"] for r in base)
    lines += [
        "",
        f"peak RSS during training, disk / in-memory (largest rank): {peak_ratio:.2f} "
        f"({(1 - peak_ratio) * 100:.0f}% lower); whole process: {whole_ratio:.2f}",
        f"step time, disk / in-memory (median step after the first, slowest rank): "
        f"{step_time(disk) / step_time(base):.2f} ({step_time(disk):.2f} s against {step_time(base):.2f} s)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
