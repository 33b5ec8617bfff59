"""Run under torchrun as one of several single-process "nodes"; writes what this rank saw to OUT_DIR/rank<R>.pt."""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_zero import ZeroStrategy  # noqa: E402
from tests.models import Recorder, TinyLM, flat_params, make_trainer  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    pl.seed_everything(3, verbose=False)
    model, recorder = TinyLM(), Recorder()
    trainer = make_trainer(ZeroStrategy(3, units=("Block",)), 1, max_steps=3, callbacks=[recorder], num_nodes=2)
    trainer.fit(model)
    torch.save(
        {
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "node_rank": trainer.node_rank,
            "losses": recorder.losses,
            "params": flat_params(model),
        },
        Path(sys.argv[1]) / f"rank{trainer.global_rank}.pt",
    )
    # Lightning leaves the process group up; tearing it down here keeps gloo's threads from aborting the
    # interpreter at exit ("terminate called without an active exception"), which torchrun reports as a failure.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
