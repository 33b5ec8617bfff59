"""One rank of a job on the emulated cluster (tests/cluster.py), under ``torchrun --nnodes 2``: ``cluster_job.py OUT
MODE``; writes what this rank saw to ``OUT/<mode>.rank<R>.pt``.

- ``parity``: a Trainer with ``num_nodes=1`` and every rank as its devices, which the launcher's nodes contradict
  (the error is recorded), then DDP, flat zero3 and zero3 with ``shard_group_size="node"`` on the same data, each
  fit's losses, topology, ``comm_stats`` and the bytes this node sent on the link during it. The script never calls
  ``destroy_process_group``, as many do not: ``OUT/exit.rank<R>.txt`` records whether a process group was still up
  when its last exit handler ran.
- ``train``: zero3 (``LZ_STRATEGY=ddp``: Lightning's DDP) for ``LZ_STEPS`` steps (long enough to be killed or cut off
  on the way), ``failure_timeout_s`` and ``heartbeat_s`` from ``LZ_FAILURE_TIMEOUT_S`` and ``LZ_HEARTBEAT_S``; on
  stdout a line per step, and, when fit raises, the time (``time.time()``) it began handling the error (``exception
  rank R t=...``) and the time its interpreter began to exit, Lightning's teardown done (``exit rank R t=...``).
"""

import atexit
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from lightning_zero import ZeroConfigError, ZeroStrategy  # noqa: E402
from tests.cluster import LINK  # noqa: E402
from tests.models import Recorder, TinyLM, flat_params, make_trainer  # noqa: E402

STEPS = 3


def link_bytes() -> int:
    """Bytes this node has sent on the link (the namespace's /sys, as ``ip netns exec`` mounted it)."""
    return int(Path(f"/sys/class/net/{LINK}/statistics/tx_bytes").read_text())


class Model(TinyLM):
    """Large enough that the model's bytes outweigh the control messages on the link (about 110K parameters)."""

    def __init__(self) -> None:
        super().__init__(d_model=64, n_layer=2)


def fit(strategy, max_steps: int = STEPS, callbacks=()) -> dict:
    pl.seed_everything(7, verbose=False)
    model, recorder = Model(), Recorder()
    trainer = make_trainer(strategy, int(os.environ["LOCAL_WORLD_SIZE"]), max_steps=max_steps,
                           callbacks=[recorder, *callbacks], num_nodes=2)
    if dist.is_initialized():  # every rank starts counting together (the first fit makes the process group)
        dist.barrier()
    sent = link_bytes()
    trainer.fit(model)
    dist.barrier()
    sent = link_bytes() - sent
    record = dict(losses=recorder.losses, params=flat_params(model), link_bytes=sent)
    if isinstance(strategy, ZeroStrategy):
        topology = strategy.topology()
        record.update(node_size=topology.node_size, shard_group_size=topology.shard_group_size,
                      cross_bytes=strategy.comm_stats.cross_group_bytes, total_bytes=strategy.comm_stats.total_bytes)
    return record


def mismatched() -> str:
    """A Trainer that takes the 2 x 2 launch for one node of 4: refused on every rank."""
    trainer = make_trainer(ZeroStrategy(3), int(os.environ["WORLD_SIZE"]), max_steps=1, num_nodes=1)
    try:
        trainer.fit(Model())
    except ZeroConfigError as err:
        return str(err)
    return "no error"


def parity() -> dict:
    record = dict(mismatch=mismatched())
    record["ddp"] = fit(DDPStrategy())
    record["zero3"] = fit(ZeroStrategy(3, units=("Block",)))
    record["hybrid"] = fit(ZeroStrategy(3, units=("Block",), shard_group_size="node"))
    return record


class Progress(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        print(f"step {trainer.global_step} rank {trainer.global_rank} t={time.time():.3f}", flush=True)

    def on_exception(self, trainer, pl_module, exception):
        rank = trainer.global_rank
        print(f"exception rank {rank} t={time.time():.3f}", flush=True)
        atexit.register(lambda: print(f"exit rank {rank} t={time.time():.3f}", flush=True))  # the first to run


def train() -> dict:
    timeout, heartbeat = float(os.environ.get("LZ_FAILURE_TIMEOUT_S", 300)), float(os.environ.get("LZ_HEARTBEAT_S", 2))
    strategy = ZeroStrategy(3, units=("Block",), failure_timeout_s=timeout, heartbeat_s=heartbeat)
    if os.environ.get("LZ_STRATEGY") == "ddp":
        strategy = DDPStrategy()
    return fit(strategy, max_steps=int(os.environ.get("LZ_STEPS", STEPS)), callbacks=[Progress()])


def record_exit(path: Path) -> None:
    """Registered first, so it runs last of the exit handlers (they run in reverse)."""
    path.write_text(f"initialized={dist.is_initialized()}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    out, mode = Path(sys.argv[1]), sys.argv[2]
    atexit.register(record_exit, out / f"exit.rank{os.environ['RANK']}.txt")
    record = {"parity": parity, "train": train}[mode]()
    torch.save(record, out / f"{mode}.rank{dist.get_rank()}.pt")
