"""A 2-rank training job for tests/integration/test_memory_limit.py: a GPT trained for a few steps with one strategy,
its ranks forked by Lightning, printing each rank's losses as one JSON line. Run under a memory limit by the test.

    python tests/integration/memlimit_job.py --strategy zero3_offload_disk --build configure_model --steps 2
"""

from __future__ import annotations

import argparse
import json
import tempfile

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.models import GPTConfig, LanguageModel

CONFIG = GPTConfig(vocab_size=1024, n_layer=8, n_head=8, d_model=640, seq_len=64)
BATCH = 4


class EagerLanguageModel(LanguageModel):
    """The same network built in ``__init__``, in full, before the strategy sees it."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config, lr=1e-4, warmup_steps=0)
        self.configure_model()


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        print(json.dumps({"rank": trainer.global_rank, "losses": self.losses}), flush=True)


def strategy(name: str, offload_dir: str):
    if name == "ddp":
        return "ddp_fork"
    options = {"stage": 3, "start_method": "fork", "units": ["Block"]}
    if name == "zero3_offload_disk":
        options.update(offload_optimizer="disk", offload_params="disk", offload_dir=offload_dir,
                       offload_subgroup_mb=8, offload_resident_subgroups=2)
    return ZeroStrategy(**options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "zero3", "zero3_offload_disk"], required=True)
    parser.add_argument("--build", choices=["configure_model", "eager"], required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = EagerLanguageModel(CONFIG) if args.build == "eager" else LanguageModel(CONFIG, lr=1e-4, warmup_steps=0)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH * 2 * args.steps, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    with tempfile.TemporaryDirectory(prefix="memlimit-job-") as offload_dir:
        trainer = pl.Trainer(
            strategy=strategy(args.strategy, offload_dir), accelerator="cpu", devices=2, max_steps=args.steps,
            callbacks=[Losses()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, train_dataloaders=data)


if __name__ == "__main__":
    main()
