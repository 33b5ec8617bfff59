"""``compare.py --gpu``: one GPU (world size 1), one fresh process per approach, bf16-mixed, a GPT of about 1.3B
parameters (d 2048, 24 layers, 16 heads, seq 2048, vocab 50304, tied embeddings, batch 8) trained through the
Lightning Trainer: the per-step cost of each implementation's machinery where there is nothing to shard.

Approaches: a single device (``strategy="auto"``), lightning_zero zero1/zero2/zero3 (the world-size-1 short cut),
zero3 with every collective really issued at world size 1 (``shortcut_single_rank=False``: the NCCL path of a
multi-GPU job), FSDP2 through Lightning's ``ModelParallelStrategy`` (``fully_shard`` per block and the root) and
DeepSpeed ZeRO-3 through Lightning's ``DeepSpeedStrategy``. Each prints one ``RESULT {json}`` line: median step time
after warm-up (a CUDA synchronisation brackets each step), tokens/s, model TFLOPS (6 N T plus attention), MFU
against ``peak_tflops`` and peak GPU memory. Speed is reported, never asserted.

Without a GPU the same code runs on the CPU at a size from ``SIZES`` (``--gpu-size tiny``: what the tests run);
peak memory is then not measured.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

#: Approaches of the GPU run, in run order, and their labels.
APPROACHES = {
    "single": "single device",
    "zero1": "lightning_zero zero1",
    "zero2": "lightning_zero zero2",
    "zero3": "lightning_zero zero3",
    "zero3_collectives": "lightning_zero zero3, collectives issued",
    "fsdp2": "FSDP2 (ModelParallelStrategy)",
    "ds_z3": "DeepSpeed ZeRO-3 (DeepSpeedStrategy)",
}
#: Dense bf16 TFLOPS of one H200 (and H100 SXM): what MFU is measured against by default.
PEAK_TFLOPS = 989.0


@dataclass(frozen=True)
class GpuSize:
    vocab: int
    d: int
    layers: int
    heads: int
    seq: int
    batch: int
    warmup: int
    steps: int

    @property
    def config(self):
        """The library's own GPT (lightning_zero.models), tied embeddings: its ``Block`` is every strategy's unit."""
        from lightning_zero.models import GPTConfig

        return GPTConfig(vocab_size=self.vocab, n_layer=self.layers, n_head=self.heads, d_model=self.d,
                         seq_len=self.seq, tie_embeddings=True)

    @property
    def n_params(self) -> int:
        return self.config.num_parameters

    def flops_per_step(self) -> float:
        tokens = self.batch * self.seq
        return 6 * self.n_params * tokens + 12 * self.layers * self.d * self.seq * tokens


SIZES = {
    "1.3B": GpuSize(vocab=50304, d=2048, layers=24, heads=16, seq=2048, batch=8, warmup=4, steps=10),
    "tiny": GpuSize(vocab=512, d=64, layers=2, heads=2, seq=32, batch=2, warmup=2, steps=3),
}


def run_one(name: str, size: GpuSize) -> dict:
    """Train ``size.warmup + size.steps`` steps of approach ``name`` in this process; return its figures."""
    import lightning.pytorch as pl

    from lightning_zero.host_math import settle_mkl_dispatch

    settle_mkl_dispatch()  # every approach, not only lightning_zero's: see lightning_zero/host_math.py
    cuda = torch.cuda.is_available()
    times: list[float] = []
    profile_dir = os.environ.get("ZBENCH_GPU_PROFILE")  # then PROFILE_STEPS more steps run under torch.profiler
    timed_steps = size.warmup + size.steps

    class Clock(pl.Callback):
        reads_parameters = False
        profiler = None

        def on_train_batch_start(self, *_args) -> None:
            if cuda:
                torch.cuda.synchronize()
            if profile_dir and len(times) == timed_steps:
                self.profiler = _start_profiler(cuda)
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *_args) -> None:
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            if self.profiler is not None and len(times) == timed_steps + PROFILE_STEPS:
                _write_profile(self.profiler, os.path.join(profile_dir, f"{name}.txt"), cuda, times[timed_steps:])

    pl.seed_everything(0, verbose=False)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = pl.Trainer(
        accelerator="cuda" if cuda else "cpu", devices=1, strategy=_strategy(name), precision="bf16-mixed",
        max_steps=timed_steps + (PROFILE_STEPS if profile_dir else 0), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Clock()],
    )
    module = _lightning_module(name, size, cuda)
    trainer.fit(module)
    timed = times[size.warmup:timed_steps]
    step = statistics.median(timed)
    flops = size.flops_per_step()
    return dict(
        name=name, label=APPROACHES[name], device=torch.cuda.get_device_name() if cuda else "cpu",
        params=size.n_params, step_ms=step * 1e3, step_ms_min=min(timed) * 1e3, step_ms_max=max(timed) * 1e3,
        tokens_per_s=size.batch * size.seq / step, tflops=flops / step / 1e12,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None, steps=len(timed),
        final_loss=module.losses[-1] if module.losses else math.nan,
    )


#: Steps profiled after the timed ones when ``ZBENCH_GPU_PROFILE`` names a folder (``compare.py --gpu-profile``).
PROFILE_STEPS = 2


def _start_profiler(cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    profiler = profile(activities=activities, record_shapes=False, with_stack=False)
    profiler.__enter__()
    return profiler


def _write_profile(profiler, path: str, cuda: bool, step_s: list[float]) -> None:
    """The profiled steps' op tables, by device time and by host time: where an approach's step differs from the
    single device's."""
    profiler.__exit__(None, None, None)
    averages = profiler.key_averages()
    with open(path, "w") as f:
        f.write(f"{PROFILE_STEPS} profiled steps, ms: {[round(t * 1e3, 1) for t in step_s]}\n\n")
        for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
            f.write(f"sorted by {key}\n{averages.table(sort_by=key, row_limit=40, max_name_column_width=80)}\n")


def _strategy(name: str):
    if name == "single":
        return "auto"
    if name.startswith("zero"):
        from lightning_zero import ZeroStrategy

        stage = int(name[4])
        units = {"units": ("Block",)} if stage == 3 else {}
        return ZeroStrategy(stage=stage, shortcut_single_rank=name != "zero3_collectives", **units)
    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    if name == "ds_z3":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=3)
    raise ValueError(f"unknown GPU approach {name!r}: choose from {', '.join(APPROACHES)}")


def _lightning_module(name: str, size: GpuSize, cuda: bool):
    import lightning.pytorch as pl

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is not None:
                return
            self.model = size.config.build()
            if name == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for block in self.model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def training_step(self, idx, _batch_idx):
            logits = self.model(idx[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))
            self.losses.append(loss.detach())
            return loss

        def on_train_end(self) -> None:
            self.losses = [float(x) for x in self.losses]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            count = size.batch * (size.warmup + size.steps)
            data = torch.randint(0, size.vocab, (count, size.seq + 1), generator=g)
            return torch.utils.data.DataLoader(data, batch_size=size.batch, pin_memory=cuda)

    return LM()


def run_all(names: list[str], size_name: str, python: str, timeout: float, env: dict) -> list[dict]:
    """Each approach in a fresh process (``python -m zbench.gpu NAME SIZE``); an approach that fails or is not
    installed is reported with its reason, the others still run."""
    results = []
    for name in names:
        t0 = time.time()
        missing = _missing(name)
        if missing:
            results.append(dict(name=name, label=APPROACHES[name], error=f"skipped: {missing} not installed"))
            continue
        try:
            proc = subprocess.run([python, "-m", "zbench.gpu", name, size_name], capture_output=True, text=True,
                                  timeout=timeout, env=env, check=False)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            result = json.loads(lines[-1][7:]) if lines else dict(
                name=name, label=APPROACHES[name], error=_last_lines(proc.stderr or proc.stdout))
        except subprocess.TimeoutExpired:
            result = dict(name=name, label=APPROACHES[name], error=f"timed out after {timeout:.0f} s")
        result["process_s"] = round(time.time() - t0, 1)
        print(f"[compare --gpu] {name}: {result.get('error', 'ok')}", flush=True)
        results.append(result)
    return results


def table(results: list[dict], peak_tflops: float = PEAK_TFLOPS) -> str:
    """The markdown table of a GPU run: step time (and against the single device), tokens/s, TFLOPS, MFU, memory."""
    base = next((r["step_ms"] for r in results if r["name"] == "single" and "error" not in r), None)
    lines = ["| approach | step ms median (min-max) | x single device | tokens/s | TFLOPS | MFU | peak GPU GiB |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['error']} | | | | | |")
            continue
        ratio = f"{r['step_ms'] / base:.3f}" if base else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        lines.append(
            f"| {r['label']} | {r['step_ms']:.1f} ({r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}) | {ratio} | "
            f"{r['tokens_per_s']:.0f} | {r['tflops']:.1f} | {r['tflops'] / peak_tflops:.3f} | {peak} |"
        )
    return "\n".join(lines)


def _missing(name: str) -> str | None:
    import importlib.util

    if name == "ds_z3" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed"
    return None


def _last_lines(text: str, n: int = 4) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-n:])[-600:]


if __name__ == "__main__":
    approach, size_name = sys.argv[1], sys.argv[2]
    figures = run_one(approach, SIZES[size_name])
    print("RESULT " + json.dumps(figures | {"size": asdict(SIZES[size_name])}), flush=True)
