"""One launch of 2 CPU ranks as separate interpreters (torchrun, or Lightning's default popen launcher, which runs this
script again for rank 1): DDP, zero1, zero2 and zero3 in sequence on a model with parameters of four dtypes, in fp32
and bf16-mixed, and a save at step 3 resumed to step 6 under each stage; in each fit rank 0 alone reads gradient
norms, and a user's ``AveragedModel`` keeps a moving average. Each rank writes what it saw to
``OUT_DIR/<label>-rank<R>.pt``; tests/integration/test_launchers.py compares the runs.

Run as ``python launcher_job.py OUT_DIR LABEL`` (popen) or under ``torchrun --nproc-per-node 2``. Parameters of
several dtypes make every loop that issues one collective per dtype (the gathers of ``release`` at the end of fit,
``gathered_gradients()``, entered here before every optimizer step) run several; where such a loop followed an order
that differs between interpreters, the ranks issue them in different orders and gloo aborts or swaps data (see
[Note: how the order of collectives is owned] in lightning_zero/sharding/collectives.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_zero import ZeroStrategy  # noqa: E402
from tests.models import CLASSES, SEQ, VOCAB, Block, token_dataset  # noqa: E402

STEPS, SAVED_AT = 6, 3
PRECISIONS = ("32-true", "bf16-mixed")
STAGES = (1, 2, 3)
#: The parameter dtypes of ``FourDtypes``, in model order.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class FourDtypes(pl.LightningModule):
    """A transformer block in fp32, a frozen bf16 position table and fp16 gain (as a 16-bit base under fp32 adapters),
    and a float64 head (as modules kept in another precision): every dtype's parameters have a different byte size, so
    a gather issued for one dtype on one rank and another on the other aborts instead of passing. The batch comes
    from (global step, rank), so a resumed run sees the data of an uninterrupted one."""

    def __init__(self, d_model: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.position = nn.Embedding(SEQ, d_model).to(torch.bfloat16).requires_grad_(False)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, d_model, dtype=torch.float16), requires_grad=False)
        self.block = Block(d_model, n_head=2)
        self.head = nn.Linear(d_model, CLASSES).double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(tokens)  # the 16-bit tables join in the working dtype (ZeRO's under bf16-mixed)
        positions = self.position(torch.arange(tokens.shape[1], device=tokens.device)).to(embedded.dtype)
        hidden = self.block((embedded + positions) * self.gain.to(embedded.dtype)).mean(dim=1)
        return self.head(hidden.double()).float()

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
        tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g).to(self.device)
        return nn.functional.cross_entropy(self(tokens), torch.randint(0, CLASSES, (4,), generator=g).to(self.device))

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(token_dataset(64), batch_size=4)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


class Seen(pl.Callback):
    """The loss, the full gradients before each optimizer step (under ZeRO through ``gathered_gradients()``, on every
    rank) and all parameters after it (under ZeRO through ``gathered_parameters()``). And what user code does that
    DDP allows: on rank 0 only, before each step, the gradients' total norm and largest magnitude (see [Note: a read
    that runs on one rank] in lightning_zero/sharding/joined_reads.py); an exponential moving average of the model
    kept in a ``torch.optim.swa_utils.AveragedModel`` made at ``on_fit_start`` and updated after every step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: list[torch.Tensor] = []
        self.params: list[torch.Tensor] = []
        self.rank_zero_norms: list[list[float]] = []
        self.average: AveragedModel | None = None

    def on_fit_start(self, trainer, pl_module):
        self.average = AveragedModel(pl_module, multi_avg_fn=get_ema_multi_avg_fn(0.75))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if trainer.is_global_zero:
            self.rank_zero_norms.append([float(sum(g.norm() ** 2 for g in grads) ** 0.5),
                                         max(float(g.abs().max()) for g in grads)])
        with getattr(trainer.strategy, "gathered_gradients", contextlib.nullcontext)():
            self.grads.append(flat(p.grad for p in pl_module.parameters() if p.grad is not None))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.average.update_parameters(pl_module)
        with getattr(trainer.strategy, "gathered_parameters", contextlib.nullcontext)():
            self.params.append(flat(pl_module.parameters()))


def fit(strategy, precision: str, steps: int = STEPS, ckpt_path: Path | None = None, save: Path | None = None) -> dict:
    pl.seed_everything(11, verbose=False)
    model, seen = FourDtypes(), Seen()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, precision=precision, callbacks=[seen],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    # After fit: ZeroStrategy has gathered the full parameters back into the module (``release``).
    return {"losses": seen.losses, "grads": seen.grads, "params": seen.params, "final": flat(model.parameters()),
            "rank_zero_norms": seen.rank_zero_norms, "average": flat(seen.average.module.parameters()),
            "trainer": trainer}


def run(root: Path) -> dict:
    out: dict = {}
    for precision in PRECISIONS:
        out[precision, "ddp"] = fit(DDPStrategy(), precision)
        for stage in STAGES:
            out[precision, stage] = fit(ZeroStrategy(stage), precision)
    for stage in STAGES:
        path = root / f"zero{stage}.ckpt"
        fit(ZeroStrategy(stage), "bf16-mixed", SAVED_AT, save=path)
        out["resumed", stage] = fit(ZeroStrategy(stage), "bf16-mixed", ckpt_path=path)
    trainer = out["32-true", "ddp"].pop("trainer")
    for value in out.values():
        value.pop("trainer", None)
    out["launch"] = {
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "global_rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "pid": os.getpid(),
        "hash_seed": os.environ.get("PYTHONHASHSEED"),
        # What a set of these dtypes iterates in, in this interpreter (addresses): differing between the ranks of a
        # launch is what made collectives mismatch where a loop followed a set's order.
        "set_order": [str(d) for d in set(DTYPES)],
    }
    return out


if __name__ == "__main__":
    out_dir, label = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    results = run(out_dir)
    rank = results["launch"]["global_rank"]
    torch.save(results, out_dir / f"{label}-rank{rank}.pt")
    # Lightning leaves the process group up; tearing it down here keeps gloo's threads from aborting the interpreter
    # at exit ("terminate called without an active exception"), which torchrun reports as a failure.
    dist.barrier()
    dist.destroy_process_group()
