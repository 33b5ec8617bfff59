"""One rank of one whole-run memory job (``benchmarks/memory_phases.py``): a fresh process that goes through every
phase a user's job goes through, and records the peak resident memory of each.

[Note: the phases of a job]
``import_build`` (process start to the model built: the interpreter, torch, Lightning, the eager model),
``setup`` (wrapping the model and building the optimizer: Lightning's strategy setup, ``fully_shard``,
``deepspeed.initialize``), ``first_step`` (the optimizer states come into being), ``steady_step`` (the largest of the
later steps), ``checkpoint_save``, ``teardown`` (the end of the run: Lightning's strategy teardown, which gives the
module its full parameters back; the loops drop their wrappers). Then, in fresh processes as a job restarted after a
failure, ``load_resume``: from the model built to the end of the first step after loading the checkpoint (set-up,
load, step).

Lightning approaches (lightning_zero's stages and offload modes, Lightning's DDP) run ``Trainer.fit`` twice, the
second time with ``ckpt_path``; the phase boundaries are callback hooks. FSDP2 and DeepSpeed run plain loops, as
their documentation shows them, with their own checkpoint calls (``torch.distributed.checkpoint`` with
``get_state_dict``; ``engine.save_checkpoint``).

[Note: peak resident memory per phase]
Each phase starts by resetting the kernel's high-water mark (``/proc/self/clear_refs`` = 5: VmHWM becomes the current
RSS) and ends by reading VmHWM, so each phase's figure is the peak RSS of the process during that phase, from process
start (everything allocated before the phase and still held counts). A thread samples ``RssAnon``, ``RssFile`` and
``RssShmem`` every few milliseconds, and at every phase boundary, and keeps each one's largest value per phase: the
split of the peak into anonymous memory (tensors, the allocator's heap) and file-mapped pages (shared libraries,
memory-mapped offload files). Page cache that is not mapped is in no process's RSS: the whole job's peak with the
page cache is the cgroup's (``memlimit``), read by the driver.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time


def _status() -> dict[str, int]:
    """The byte-valued fields of /proc/self/status."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
    return out


class PhaseProbe:
    """Peak RSS per phase, split into anonymous, file-mapped and shared memory (see [Note: peak resident memory per
    phase]). ``start(name)`` ends the phase running, if any, and starts ``name``; a phase run twice keeps its larger
    figures."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.phases: dict[str, dict] = {}
        self.resettable = True
        self._name: str | None = "import_build"  # from process start: no reset
        self._split = [0, 0, 0]
        self._started = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = interval_s
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def _sample(self) -> None:
        s = _status()
        with self._lock:
            values = (s.get("RssAnon", 0), s.get("RssFile", 0), s.get("RssShmem", 0))
            self._split = [max(a, b) for a, b in zip(self._split, values)]

    def start(self, name: str) -> None:
        self.end()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:  # not permitted: VmHWM stays the process's lifetime peak
            self.resettable = False
        with self._lock:
            self._name, self._split, self._started = name, [0, 0, 0], time.perf_counter()
        self._sample()

    def end(self) -> None:
        if self._name is None:
            return
        self._sample()
        s = _status()
        with self._lock:
            anon, file, shmem = self._split
            record = dict(hwm=s["VmHWM"], anon=anon, file=file, shmem=shmem, rss_end=s["VmRSS"],
                          seconds=time.perf_counter() - self._started)
            previous = self.phases.get(self._name)
            if previous is not None:
                record = {k: max(v, previous[k]) for k, v in record.items()}
            self.phases[self._name] = record
            self._name = None

    def close(self) -> None:
        self.end()
        self._stop.set()
        self._thread.join()


PROBE = PhaseProbe()  # the first thing a rank does: import_build is measured from process start

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


class LossGPT(nn.Module):
    """``lightning_zero.models.GPT`` with the loss in its forward, ``(tokens, targets) -> loss``, so that every
    approach (Lightning module, FSDP2 loop, DeepSpeed engine) calls it the same way; ``blocks`` are its units."""

    def __init__(self, config) -> None:
        super().__init__()
        self.net = config.build()

    @property
    def blocks(self) -> nn.ModuleList:
        return self.net.blocks

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(idx).flatten(0, 1).float(), targets.flatten())


def model_config(spec: dict):
    from lightning_zero.models import GPTConfig

    return GPTConfig(**spec["model"])


def batches(spec: dict, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    config = spec["model"]
    gen = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, config["vocab_size"], (count, spec["batch"], config["seq_len"] + 1), generator=gen)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def make_optimizer(params) -> torch.optim.Optimizer:
    from zbench.model import make_optimizer as bench_optimizer

    return bench_optimizer(params)


# ----------------------------------------------------------------------------------------------------------------------
# Lightning approaches
# ----------------------------------------------------------------------------------------------------------------------
def run_lightning(spec: dict, approach, rank: int, world: int) -> dict:
    import lightning.pytorch as pl

    data = batches(spec, rank, spec["steps"] + 1)
    eager = spec["build"] == "eager"
    config = model_config(spec)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LossGPT(config) if eager else None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = LossGPT(config)

        def training_step(self, batch, batch_idx):
            return self.model(*batch)

        def configure_optimizers(self):
            return make_optimizer(self.parameters())

    class Phases(pl.Callback):
        reads_parameters = False  # lightning_zero's zero1/zero2 may keep their gathers in flight

        def __init__(self, resuming: bool, save_to: str) -> None:
            self.resuming, self.save_to = resuming, save_to

        def setup(self, trainer, pl_module, stage):
            PROBE.start("load_resume" if self.resuming else "setup")

        def on_train_start(self, trainer, pl_module):
            if not self.resuming:
                PROBE.start("first_step")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.resuming:
                PROBE.end()
                return
            PROBE.start("steady_step")
            if trainer.global_step == spec["steps"]:
                PROBE.start("checkpoint_save")
                trainer.save_checkpoint(self.save_to)
                PROBE.end()

        def on_train_end(self, trainer, pl_module):
            if not self.resuming:
                info.update(_lightning_info(trainer))  # before the teardown (disk offload drops its files there)
                PROBE.start("teardown")

    module = Module()
    PROBE.start("between")
    info: dict = {"params": sum(p.numel() for p in module.parameters())}
    resuming = spec.get("resume", False)
    path = _checkpoint_path(spec, approach)
    trainer = pl.Trainer(
        strategy=_strategy(approach, world, spec["workdir"], spec["subgroup_mb"]), accelerator="cpu", devices=world, num_nodes=1,
        max_steps=spec["steps"] + resuming, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
        callbacks=[Phases(resuming, path)],
    )
    loader = torch.utils.data.DataLoader(_Listed(data if resuming else data[:-1]), batch_size=None)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=path if resuming else None)
    PROBE.start("between")
    return info


def _strategy(approach, world: int, workdir: str, subgroup_mb: float):
    """``zbench.approaches.make_strategy``'s, with disk offload's files under ``workdir``."""
    from zbench.approaches import BUCKET_MB, block_units, make_strategy

    if "disk" not in approach.options.values():
        return make_strategy(approach, world)
    from lightning_zero import ZeroStrategy

    return ZeroStrategy(bucket_mb=BUCKET_MB, **block_units(approach), offload_dir=workdir,
                        offload_subgroup_mb=subgroup_mb, **approach.options)


def _lightning_info(trainer) -> dict:
    """Model-state bytes the strategy counts (lightning_zero) after the last step, for the report."""
    counter = getattr(trainer.strategy, "model_state_bytes", None)
    if not callable(counter):
        return {}
    held = counter()
    return {"held": dict(params=held.params, grads=held.grads, optimizer=held.optimizer, host=held.host,
                         disk=held.disk, buffers=held.buffers, buffers_host=held.buffers_host)}


class _Listed(torch.utils.data.Dataset):
    def __init__(self, items) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _checkpoint_path(spec: dict, approach) -> str:
    return os.path.join(spec["workdir"], f"{approach.name}.ckpt")


# ----------------------------------------------------------------------------------------------------------------------
# loop approaches (FSDP2, DeepSpeed)
# ----------------------------------------------------------------------------------------------------------------------
def run_loop(spec: dict, approach, rank: int, world: int) -> dict:
    from zbench.approaches import build_loop

    data = batches(spec, rank, spec["steps"] + 1)
    model = LossGPT(model_config(spec))
    info = {"params": sum(p.numel() for p in model.parameters())}
    path = _checkpoint_path(spec, approach)
    if spec.get("resume", False):
        PROBE.start("load_resume")
        run = build_loop(approach, model, spec["batch"])
        del model
        _load(approach, run, path)
        run.fwd_bwd(*data[-1])
        run.step()
        PROBE.start("between")
        return info
    PROBE.start("setup")
    run = build_loop(approach, model, spec["batch"])
    del model
    for step, (x, y) in enumerate(data[:-1]):
        PROBE.start("first_step" if step == 0 else "steady_step")
        run.fwd_bwd(x, y)
        run.step()
    PROBE.start("checkpoint_save")
    state = _save(approach, run, path)
    PROBE.start("teardown")
    del run, state
    gc.collect()
    PROBE.start("between")
    return info


def _save(approach, run, path: str):
    if approach.name.startswith("ds_"):
        run.label_roots["engine"].save_checkpoint(path)
        return None
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    module, optim = run.params.__self__, run.optimizers[0]
    model_state, optim_state = get_state_dict(module, optim)
    state = {"model": model_state, "optim": optim_state}
    dcp.save(state, checkpoint_id=path)
    return state


def _load(approach, run, path: str) -> None:
    if approach.name.startswith("ds_"):
        run.label_roots["engine"].load_checkpoint(path)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    module, optim = run.params.__self__, run.optimizers[0]
    model_state, optim_state = get_state_dict(module, optim)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


# ----------------------------------------------------------------------------------------------------------------------
def main(spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    from zbench.approaches import APPROACHES, import_for, init_process_group

    approach = APPROACHES[spec["approach"]]
    import_for(approach)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if approach.kind == "loop":
        init_process_group(approach)
    baseline = _status()["VmRSS"]  # the interpreter, the libraries and (loops) the process group, before the model
    runner = run_lightning if approach.kind == "lightning" else run_loop
    info = runner(spec, approach, rank, world)
    PROBE.close()
    phases = {k: v for k, v in PROBE.phases.items() if k != "between"}
    record = dict(approach=approach.name, rank=rank, world=world, baseline=baseline, phases=phases,
                  peak=max(p["hwm"] for p in PROBE.phases.values()), resettable=PROBE.resettable,
                  **info)
    out = os.path.join(spec["outdir"], f"{approach.name}{'.resume' if spec.get('resume') else ''}.rank{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(out + ".tmp", out)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
