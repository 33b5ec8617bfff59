"""A 2-rank training job for tests/integration/test_memory_limit.py: a GPT trained for a few steps with one strategy,
its ranks forked by Lightning, printing each rank's losses as one JSON line (and rank 0 the run report's lines on the
host budget and disk offload). Run under a memory limit by the test.

    python tests/integration/memlimit_job.py --model gpt --strategy zero3_offload_disk --build configure_model

``--model gpt`` is the project's GPT with disk offload's options tuned by hand (8 MiB sub-groups, 2 resident);
``--model gpt2`` is transformers' GPT-2 built from its config, as a user's would be (imported in every rank), with
every option left at its default.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.models import GPTConfig, LanguageModel
from lightning_zero.monitor import ZeroMonitor

CONFIGS = {
    "gpt": lambda: GPTConfig(vocab_size=1024, n_layer=8, n_head=8, d_model=640, seq_len=SEQ),
    "gpt2": lambda: _hf_gpt2(),
}
SEQ = 64
VOCAB = 1024
BATCH = 4


def _hf_gpt2():
    import transformers  # noqa: F401

    from lightning_zero.models.hf import HFModelConfig

    return HFModelConfig("gpt2", dict(vocab_size=VOCAB, n_layer=8, n_head=8, n_embd=640, n_positions=SEQ,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _emit(record: dict) -> None:
    """One JSON line in one write: the forked ranks share stdout, and print() may write the text and the newline
    apart, so two ranks' lines could interleave (seen once: rank 1's line inside rank 0's)."""
    os.write(1, (json.dumps(record) + "\n").encode())


class EagerLanguageModel(LanguageModel):
    """The same network built in ``__init__``, in full, before the strategy sees it."""

    def __init__(self, config) -> None:
        super().__init__(config, lr=1e-4, warmup_steps=0)
        self.configure_model()


class Losses(pl.Callback):
    reads_parameters = False

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        _emit({"rank": trainer.global_rank, "losses": self.losses})


def strategy(model: str, name: str, offload_dir: str):
    if name == "ddp":
        return "ddp_fork"
    if model == "gpt2":  # every option at its default (the files in TMPDIR) but the start method, for CI's time
        disk = {"offload_optimizer": "disk", "offload_params": "disk"} if name == "zero3_offload_disk" else {}
        return ZeroStrategy(stage=3, start_method="fork", **disk)
    options = {"stage": 3, "start_method": "fork", "units": ["Block"]}
    if name == "zero3_offload_disk":
        options.update(offload_optimizer="disk", offload_params="disk", offload_dir=offload_dir,
                       offload_subgroup_mb=8, offload_resident_subgroups=2)
    return ZeroStrategy(**options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=list(CONFIGS), default="gpt")
    parser.add_argument("--strategy", choices=["ddp", "zero3", "zero3_offload_disk"], required=True)
    parser.add_argument("--build", choices=["configure_model", "eager"], required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = CONFIGS[args.model]()
    model = EagerLanguageModel(config) if args.build == "eager" else LanguageModel(config, lr=1e-4, warmup_steps=0)
    tokens = torch.randint(0, VOCAB, (BATCH * 2 * args.steps, SEQ + 1), generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    with tempfile.TemporaryDirectory(prefix="memlimit-job-") as offload_dir:
        monitor = ZeroMonitor(summary_file=f"{offload_dir}/zero_monitor.json")  # forked ranks: rank 0 writes it
        trainer = pl.Trainer(
            strategy=strategy(args.model, args.strategy, offload_dir), accelerator="cpu", devices=2,
            max_steps=args.steps, callbacks=[Losses(), monitor], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(model, train_dataloaders=data)
        _emit({"report": monitor.report().splitlines()})


if __name__ == "__main__":
    main()
