"""Muon under ZeRO against DDP (issue 36): step time and optimizer-state bytes per rank, side by side in one run.

Under DDP every rank orthogonalizes every matrix; under lightning_zero's ownership (sharding/ownership.py) each matrix
is orthogonalized once, by the rank that owns it. The model is optimizer-heavy on purpose (Muon's step a large share
of DDP's step): ``depth`` square ``width`` x ``width`` layers on ``batch`` vectors, Muon for the matrices and AdamW
for the biases (two optimizers, Lightning's manual optimization), 2 CPU ranks on gloo, one thread each. Each approach
runs as its own 2-rank job, the approaches alternating over ``--rounds``; the figure is the median step time over
the rounds' steady steps (the first two of each run left out), with the CPU time per step beside it. AdamW under DDP
and under zero2 (rows) are the reference without Muon.

    python benchmarks/optimizers.py                       # about 5 minutes on 2 cores
    python benchmarks/optimizers.py --steps 6 --rounds 1  # a quick look

Prints a Markdown table and writes ``--results`` (JSON). The state bytes are measured on each rank (every tensor of
the optimizers' states) beside the estimate (``ownership.owned_elements`` times Muon's 4 bytes per element, plus
AdamW's 8 per element of its rows).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

APPROACHES = ("ddp", "zero1", "zero2", "ddp_adamw", "zero2_adamw")


class Wide(pl.LightningModule):
    def __init__(self, width: int, depth: int, batch: int, optimizer: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.batch, self.width, self.optimizer_name = batch, width, optimizer
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        for layer in self.layers:
            x = torch.tanh(layer(x))
        loss = nn.functional.mse_loss(x, y)
        self.manual_backward(loss)
        optimizers = self.optimizers()
        for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
            optimizer.step()
            optimizer.zero_grad()
        return loss

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.dim() == 2]
        biases = [p for p in self.parameters() if p.dim() < 2]
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return [torch.optim.Muon(matrices, lr=2e-2), torch.optim.AdamW(biases, lr=1e-3)]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n = self.batch * 64
        return DataLoader(TensorDataset(torch.randn(n, self.width, generator=g), torch.randn(n, self.width, generator=g)),
                          batch_size=self.batch)


class StepTimes(pl.Callback):
    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_train_batch_start(self, *_args) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, *_args) -> None:
        self.wall.append(time.perf_counter() - self._start[0])
        self.cpu.append(time.process_time() - self._start[1])


def _strategy(approach: str):
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    if approach.startswith("ddp"):
        return DDPStrategy()
    return ZeroStrategy(stage=int(approach[4]))


def _rank(rank: int, approach: str, args: argparse.Namespace, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", NODE_RANK="0")
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = Wide(args.width, args.depth, args.batch, "adamw" if approach.endswith("adamw") else "muon")
    times = StepTimes()
    trainer = pl.Trainer(strategy=_strategy(approach), accelerator="cpu", devices=2, max_steps=args.steps * (
        1 if approach.endswith("adamw") else 2), callbacks=[times], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    state = sum(v.numel() * v.element_size() for o in trainer.optimizers for st in o.state.values()
                for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    muon = sum(v.numel() * v.element_size() for o in trainer.optimizers if type(o).__name__ == "Muon"
               for st in o.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    queue.put((rank, {"wall": times.wall[2:], "cpu": times.cpu[2:], "state_bytes": state, "muon_state_bytes": muon}))


def run(approach: str, args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, approach, args, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return [results[0], results[1]]


def estimate(args: argparse.Namespace) -> list[int]:
    """Optimizer-state bytes per rank by the estimate: Muon's momentum on the matrices each rank owns, AdamW's two
    moments on its rows of the biases."""
    from lightning_zero.sharding.ownership import owned_elements

    matrices = [torch.Size((args.width, args.width))] * args.depth
    rows = math.ceil(args.width / 2)
    return [4 * n + 8 * args.depth * min(rows, args.width - r * rows) for r, n in enumerate(owned_elements(matrices, 2))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", default="benchmarks/results/optimizers.json")
    args = parser.parse_args()
    runs: dict[str, list] = {a: [] for a in APPROACHES}
    for _ in range(args.rounds):
        for approach in APPROACHES:
            runs[approach].append(run(approach, args))
    summary = {}
    for approach, rounds in runs.items():
        wall = [t for ranks in rounds for t in ranks[0]["wall"]]
        cpu = [t for ranks in rounds for rank in ranks for t in rank["cpu"]]
        summary[approach] = {"step_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
                             "state_bytes": [rank["state_bytes"] for rank in rounds[0]],
                             "muon_state_bytes": [rank["muon_state_bytes"] for rank in rounds[0]]}
    summary["estimate_state_bytes"] = estimate(args)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps({"args": vars(args), "summary": summary}, indent=1))
    print(table(summary))


def table(summary: dict) -> str:
    ddp = summary["ddp"]["step_s"]
    lines = ["| approach | step (s) | / DDP+Muon | CPU per rank-step (s) | optimizer state per rank (MiB) |",
             "|---|--:|--:|--:|--:|"]
    for approach in APPROACHES:
        row = summary[approach]
        state = " / ".join(f"{b / 2**20:.1f}" for b in row["state_bytes"])
        lines.append(f"| {approach} | {row['step_s']:.3f} | {row['step_s'] / ddp:.2f} | {row['cpu_s']:.3f} | {state} |")
    lines.append("")
    lines.append("estimate of the state per rank under zero1/zero2 (MiB): " + " / ".join(
        f"{b / 2**20:.1f}" for b in summary["estimate_state_bytes"]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
