"""One rank of one run: a fresh process that trains ``warmup + steps`` steps of one approach and writes a JSON record.

[Note: what one step's time covers]
Every step starts with a barrier that is neither timed nor counted, so all ranks start together; the clock then runs
over forward, backward, the optimizer step and zeroing of the gradients (for Lightning runs: from
``on_train_batch_start`` to ``on_train_batch_end``, which adds the Trainer's own bookkeeping; plain Lightning DDP pays
the same). The driver takes, per step, the slowest rank's time. Held-tensor bytes are counted once, after backward
of the last warm-up step (optimizer states exist from the first step on), outside the clock.

[Note: peak RSS per phase]
The process's peak RSS is read three ways: over its whole life (``peak_rss``: imports, model build, wrapping,
training), over the training steps only (``peak_train``: the kernel's high-water mark is reset right before the first
step), and per phase of a timed step (``phase_peaks``: how far above the RSS at the step's start the peak went during
forward+backward, including gradient reduction, and during the optimizer step, including parameter all-gathers; the
second phase starts from the RSS left after backward, which glibc may not have returned to the system yet).
For Lightning runs the phase boundary is ``on_before_optimizer_step``, after Lightning's closure ran forward and
backward; for loop runs it is the return of ``fwd_bwd``.

[Note: CPU time]
Beside its wall-clock time, each step records the CPU time of the rank's process over the same span
(``time.process_time()``: every thread, gloo's among them, user and system). Time the hypervisor gives to other guests
(steal, which the driver records per run) and time spent blocked on a peer count in the wall-clock time but not here:
the CPU time is how much work an approach does per step, whatever its overlap. It still moves with the speed of the
host's cores, as the wall-clock time does (measured: BENCHMARKS.md findings).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from zbench.approaches import (
    APPROACHES, LoopRun, build_loop, extra_callbacks, import_for, init_process_group, make_strategy,
)
from zbench.measure import CollectiveCounter, PeakRss, held_tensor_bytes, peak_rss, rss_now, wchar
from zbench.model import ModelSize, build_model, compile_model, make_batches, make_optimizer


class Recorder:
    """Per-step clock, communication and loss of one rank (see [Note: what one step's time covers])."""

    def __init__(self, counter: CollectiveCounter, warmup: int, total: int, distributed: bool,
                 profile_dir: str | None = None) -> None:
        self.counter = counter
        self.warmup = warmup
        self.total = total
        self.profile_dir = profile_dir
        self._profiler = None
        self.timers = None
        self.phases: list[dict] = []
        self.peak_setup = 0
        self.peak_train = 0
        self.phase_peaks: dict[str, int] = {}
        self.distributed = distributed
        self.times: list[float] = []
        self.cpu: list[float] = []  # CPU seconds of this process (all its threads) per step, see [Note: CPU time]
        self.losses: list[float] = []
        self.comm: list[dict] = []
        self.wire: list[int] = []
        self.memory: dict | None = None
        self.extra: dict = {}
        self._t0 = 0.0
        self._c0 = 0.0
        self._paused = 0.0
        self._paused_cpu = 0.0

    def begin(self) -> None:
        if not self.times:
            # Everything before the first step (imports, model build, wrapping) is "setup"; from here on the peak
            # RSS is tracked per phase of each step (see [Note: peak RSS per phase]).
            self.peak_setup = peak_rss()
            self._peak = PeakRss()
        self._peak.take()
        self._rss0 = rss_now()
        if self.profile_dir and len(self.times) == self.warmup:
            self._start_profiler()
        if self.distributed:
            import torch.distributed as dist

            self.counter.enabled = False
            dist.barrier()
            self.counter.enabled = True
        self._snap = self.counter.snapshot()
        self._timer_snap = self.timers.snapshot() if self.timers else None
        self._w0 = wchar()
        self._paused = self._paused_cpu = 0.0
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()

    def phase(self, name: str) -> None:
        """End of a phase of the current step: keep its peak RSS above the RSS at the step's start."""
        peak = self._peak.take()
        self.peak_train = max(self.peak_train, peak)
        if len(self.times) >= self.warmup:  # timed steps only: the first step also allocates optimizer states
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), peak - self._rss0)

    def measure(self, step: int, fn) -> None:
        """Run ``fn`` (a memory count) outside the clock and the communication count, in the last warm-up step."""
        if step != self.warmup - 1:
            return
        t, c = time.perf_counter(), time.process_time()
        self.counter.enabled = False
        try:
            fn()
        finally:
            self.counter.enabled = True
            self._paused += time.perf_counter() - t
            self._paused_cpu += time.process_time() - c

    def end(self, loss) -> None:
        elapsed = time.perf_counter() - self._t0 - self._paused
        self.cpu.append(time.process_time() - self._c0 - self._paused_cpu)
        self.phase("step")  # before the step is appended: phase() counts it as the current step
        w1 = wchar()
        self.times.append(elapsed)
        self.comm.append(CollectiveCounter.delta(self.counter.snapshot(), self._snap))
        self.wire.append(w1 - self._w0)
        self.losses.append(float(loss))
        if self.timers:
            now = self.timers.snapshot()
            self.phases.append({n: [now[n][0] - self._timer_snap[n][0], now[n][1] - self._timer_snap[n][1]]
                                for n in now})
        if self._profiler is not None and len(self.times) == self.total:
            self._stop_profiler()

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False)
        self._profiler.__enter__()

    def _stop_profiler(self) -> None:
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        steps = self.total - self.warmup
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=70)
        with open(f"{self.profile_dir}.txt", "w") as f:
            f.write(f"torch.profiler, {steps} timed steps, step times ms "
                    f"{[round(1000 * t) for t in self.times[self.warmup:]]}\n{table}\n")
        prof.export_chrome_trace(f"{self.profile_dir}.trace.json")


def run_loop(approach, model, batches, rec: Recorder, batch: int) -> dict:
    run: LoopRun = build_loop(approach, model, batch)
    info = dict(run.info)
    for step, (x, y) in enumerate(batches):
        rec.begin()
        loss = run.fwd_bwd(x, y)

        def count():
            rec.memory = held_tensor_bytes(
                run.params(), run.optimizers, extra_params=run.extra_params() if callable(run.extra_params) else (),
                label_roots=run.label_roots,
            )

        rec.phase("fwd_bwd")
        rec.measure(step, count)
        run.step()
        rec.end(loss.detach())
    return info


def run_lightning(approach, model, batches, rec: Recorder, world: int) -> dict:
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy

    class BenchModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.model(x, y)

        def configure_model(self):
            """Lightning's ModelParallelStrategy leaves the sharding to the module, as its documentation shows:
            ``fully_shard`` each Block, then the root (reshard after forward, FSDP2's default)."""
            if type(self.trainer.strategy).__name__ != "ModelParallelStrategy":
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for module in self.model.modules():
                if type(module).__name__ == "Block":
                    fully_shard(module, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def configure_optimizers(self):
            return make_optimizer(self.parameters())

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_Batches(batches), batch_size=None, shuffle=False)

    info: dict = {}

    class Hooks(pl.Callback):
        reads_parameters = False  # timings, byte counts and the loss: lightning_zero's gathers may stay in flight

        def on_train_start(self, trainer, pl_module):
            # Lightning registers DDP comm hooks only on CUDA; route DDP's all-reduces through Python on CPU too,
            # as for the raw DDP loop (measure.py).
            from torch.nn.parallel import DistributedDataParallel

            if isinstance(trainer.strategy.model, DistributedDataParallel):
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                trainer.strategy.model.register_comm_hook(None, default_hooks.allreduce_hook)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            zero = isinstance(trainer.strategy, ZeroStrategy)
            rec.begin()
            if zero:
                trainer.strategy.comm_stats.reset()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            rec.phase("fwd_bwd")

            def count():
                strategy = trainer.strategy
                held = {}
                if isinstance(strategy, ZeroStrategy):
                    held = strategy.runtime.held_tensors()
                    own = strategy.model_state_bytes()
                    info["own_model_state"] = dict(params=own.params, grads=own.grads, optimizer=own.optimizer,
                                                   total=own.total)
                rec.memory = held_tensor_bytes(
                    pl_module.parameters(), [getattr(o, "_optimizer", o) for o in trainer.optimizers],
                    extra_params=held.get("extra_params", ()), extra_grads=held.get("extra_grads", ()),
                    extra_optim=held.get("extra_optimizer", ()),
                )

            rec.measure(trainer.global_step, count)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            rec.end(loss.detach())
            if isinstance(trainer.strategy, ZeroStrategy) and batch_idx >= rec.warmup:
                own = {op: s.bytes for op, s in trainer.strategy.comm_stats.by_op.items()}
                rec.extra.setdefault("own_comm", []).append(own)

    trainer = pl.Trainer(
        strategy=make_strategy(approach, world),
        accelerator="cpu",
        devices=world if approach.distributed else 1,
        num_nodes=1,
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        callbacks=[Hooks(), *extra_callbacks(approach)],
    )
    trainer.fit(BenchModule())
    return info


class _Batches(torch.utils.data.Dataset):
    def __init__(self, batches) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


def main(spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    counter = CollectiveCounter()
    counter.install()  # before DDP, FSDP2, DeepSpeed or lightning_zero is imported
    approach = APPROACHES[spec["approach"]]
    t_start = time.time()
    import_for(approach)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if approach.distributed:
        init_process_group(approach)
    rss_base = rss_now()
    size = ModelSize(**spec["size"])
    total = spec["warmup"] + spec["steps"]
    batches = make_batches(size, spec["batch"], total, rank)
    model = build_model(size)
    n_params = sum(p.numel() for p in model.parameters())
    if approach.compiled:
        compile_model(model, approach.compiled)
    profile = spec.get("profile") and os.path.join(spec["outdir"], f"{spec['run_id']}.rank{rank}.torchprof")
    rec = Recorder(counter, spec["warmup"], total, approach.distributed, profile_dir=profile or None)
    if spec.get("timers"):
        from zbench.measure import PhaseTimers

        rec.timers = PhaseTimers(spec["timers"])
    if approach.kind == "loop":
        info = run_loop(approach, model, batches, rec, spec["batch"])
    else:
        info = run_lightning(approach, model, batches, rec, world)
    result = dict(
        approach=approach.name, rank=rank, world=world, n_params=n_params, threads=torch.get_num_threads(),
        torch=torch.__version__, setup_s=time.time() - t_start - sum(rec.times), info=info,
        times=rec.times, cpu=rec.cpu, losses=rec.losses, comm=[{k: list(v) for k, v in c.items()} for c in rec.comm],
        wire=rec.wire, memory=rec.memory, rss_base=rss_base, rss_end=rss_now(), peak_setup=rec.peak_setup,
        peak_rss=max(rec.peak_setup, rec.peak_train), peak_train=rec.peak_train, phase_peaks=rec.phase_peaks,
        extra=rec.extra, phases=rec.phases,
    )
    out = os.path.join(spec["outdir"], f"{spec['run_id']}.rank{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    if approach.distributed:
        import torch.distributed as dist

        counter.enabled = False
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
