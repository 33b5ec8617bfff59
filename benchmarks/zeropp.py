#!/usr/bin/env python
"""Beyond one node (issue 28): the bytes that cross nodes per step under flat ZeRO, hybrid sharding and ZeRO++'s
options, from the strategy's own accounting and from the sockets, beside the formulas, the step time, and FSDP2 flat
and HSDP (2-D mesh) in the same run; and (``--curves``) the loss curves of the quantized options against two seeds of
the unquantized run.

[Note: the runs of the ZeRO++ benchmark]
Every configuration runs 4 CPU ranks over gloo, one fresh process each, as 2 nodes x 2 (``node_size=2``: ranks 0-1
are one node, 2-3 the other), on the small GPT of ``lightning_zero/models`` (``conf/model/gpt_small``: 0.84M
parameters, 4 blocks of width 128, byte vocabulary), fp32 (b = 4 bytes an element), 8 sequences of 128 tokens a rank
and step drawn from the standard library's source (``lightning_zero/data/corpus.py``), the same on every
configuration for one seed. lightning_zero runs through Lightning's Trainer (stage 3 with the GPT's ``Block`` as its
units); FSDP2 is ``fully_shard`` per Block and on the root, with a 1-D mesh of 4 (flat) or a 2-D mesh (replicate 2,
shard 2: HSDP), in a plain loop with the same AdamW and schedule.

Bytes: each rank snapshots its own TCP sockets at the start of step ``warmup`` and of step ``warmup + steps``
(zbench/sockets.py, [Note: counting bytes on the sockets]), beside ``strategy.comm_stats`` (``cross_group_bytes``,
``total_bytes``); the difference over the ``steps`` steps between is divided by ``steps``. The measuring callback
reads parameters in ``on_train_batch_start`` (it does not declare ``reads_parameters = False``), so stage 1/2's
post-step all-gather is complete at each snapshot: nothing is in flight across one. Step time: per step, the slowest
rank's time from one ``on_train_batch_start`` to the next (the snapshot itself left out), the median over the
measured steps. Four single-threaded ranks time-slice the machine's cores, so the step times compare configurations
with one another, not with a real cluster, where the cross-node links would be the slow ones.

Curves: 300 steps, flat ZeRO-3 on the same 4 ranks, the global batch's loss per step (the mean over ranks of each
rank's loss), for each entry of ``CURVES``: the mean of the last 50 steps against the unquantized run of the same
seed, and the spread of the unquantized runs of two seeds.

[Note: the learning rate of the curves]
A quantized run is set against the unquantized run of its own seed, so the comparison measures quantization only
where the unquantized runs themselves are reproducible. At the bytes runs' peak learning rate, 2e-3, they are not:
of three seeds, one sits on a plateau near loss 3.0 (the byte bigrams, before attention is of use) for ~100 steps and
ends its last 50 steps at 2.43 where the others end at 2.00 and 2.08 (17-21% apart), and whichever run a
perturbation, quantized or not, pushes off the plateau earlier ends percents lower (the first curves, at 2e-3, had
qgZ -14.9% on that seed and +2.7% on the other). At 1e-3 the three seeds end within 0.8% of one another (2.176,
2.194, 2.180; a single-process replay of the same data and arithmetic), so the curves run at 1e-3.

    python benchmarks/zeropp.py                   # bytes and step time, every configuration (~5-10 min on 2 cores)
    python benchmarks/zeropp.py --configs zero3,zero3_hybrid --steps 4
    python benchmarks/zeropp.py --curves          # loss curves (~10-15 min on 2 cores)
    python benchmarks/zeropp.py --report-only     # print the report of benchmarks/results/zeropp.json

Writes ``--results`` (default benchmarks/results/zeropp.json; each mode replaces its own part) and, with
``--curves``, ``benchmarks/results/zeropp_curves.png`` (matplotlib: skipped, saying so, where it is missing);
BENCHMARKS.md renders the last run's (``compare.py --report-only benchmarks/results/full.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

RESULTS = os.path.join(HERE, "results", "zeropp.json")
CURVES_PNG = os.path.join(HERE, "results", "zeropp_curves.png")

WORLD, NODE = 4, 2
#: conf/model/gpt_small.yaml.
MODEL = dict(vocab_size=256, n_layer=4, n_head=4, d_model=128, seq_len=128)
#: ``--quick`` and the test: a few seconds of steps, still well above gloo's per-message headers.
TINY = dict(vocab_size=256, n_layer=2, n_head=2, d_model=96, seq_len=32)
BATCH = 8
OPTIMIZER = dict(lr=2e-3, weight_decay=0.1, warmup_steps=20, min_lr_ratio=0.1, betas=(0.9, 0.95))
QUANT_BLOCK = 4096  # qwZ's elements per fp32 scale (sharding/quantize.py)


@dataclass(frozen=True)
class Sizes:
    """Parameter counts of the model: ``units`` in the Blocks (stage 3's units), ``root`` the rest (tied embedding,
    positions, final norm), gathered once a step; ``last`` in the last Block, which stage 3 keeps gathered from its
    forward to its backward (0 in results measured before it did); ``b`` bytes an element."""

    units: int
    root: int
    b: int = 4
    last: int = 0

    @property
    def psi(self) -> int:
        return self.units + self.root

    @property
    def gathered(self) -> int:
        """Elements stage 3 gathers a step: the Blocks in forward and again in backward, but the last; the root once."""
        return 2 * self.units - self.last + self.root


#: Of the model's bytes, the share a rank sends across nodes per all-gather at 2 nodes x 2: the gathers run node by
#: node (by_node.py, [Note: hierarchical collectives]), each rank sending its quarter once, to the rank at its
#: position on the other node.
AG_SHARE = 1 / WORLD
#: The share a rank sends across per reduce-scatter: its node's partial sum of the other node's quarter at its position.
RS_SHARE = 1 / WORLD


def _zero12(s: Sizes, ag: float) -> float:
    """Flat ZeRO-1/2: one reduce-scatter of the gradients, one all-gather of the updated parameters."""
    return s.psi * s.b * (RS_SHARE + ag)


def _zero3(s: Sizes, ag: float, gather_bytes: float | None = None) -> float:
    """Flat ZeRO-3: the units gathered twice (forward and backward, at ``gather_bytes`` an element: b unless qwZ)
    but the last, and reduced once, the root gathered once and reduced once."""
    gather = s.b if gather_bytes is None else gather_bytes
    return ag * gather * s.gathered + RS_SHARE * s.psi * s.b


def _replica_allreduce(s: Sizes, ag: float) -> float:
    """Hybrid sharding: only the all-reduce of the reduced shard (Psi/2) across the replica group of 2 crosses; a
    ring of 2 sends 2(n-1)/n of it, the whole shard, to the other node. Nothing of the shard group crosses."""
    return s.psi / NODE * s.b


#: qwZ's bytes an element: the int8 payload and one fp32 scale per block.
QWZ_BYTES = 1 + 4 / QUANT_BLOCK
#: qgZ's (int4) bytes an element: two codes a byte and one fp32 scale per block.
QGZ_BYTES = 0.5 + 4 / QUANT_BLOCK


def _zero3_hpz(s: Sizes, ag: float, forward_bytes: float | None = None) -> float:
    """Flat ZeRO-3 with hpZ: the backward gathers run inside the node; the forward's (b, or qwZ's bytes) still
    cross, and so does the reduce-scatter."""
    forward = s.b if forward_bytes is None else forward_bytes
    return ag * s.psi * forward + RS_SHARE * s.psi * s.b


def _qgz_reduce(s: Sizes) -> float:
    """qgZ's second stage: a rank sends its node's partial sum of one segment (Psi/4 elements as int4 payloads) to
    the rank at its position on the other node (blocks restart per parameter: a little more)."""
    return s.psi / WORLD * QGZ_BYTES


@dataclass(frozen=True)
class Config:
    """One configuration of the bytes run. ``options``: ZeroStrategy's (``kind="lz"``) or the FSDP2 mesh shape
    (``kind="fsdp2"``); ``gloo``: what crosses per rank and step on gloo's algorithms, as text and as a function of
    the sizes and the all-gather's share (None: not modelled); ``paper``: the volume the ZeRO / ZeRO++ papers give
    per rank and step on a ring, in Psi*b."""

    name: str
    label: str
    kind: str
    options: dict = field(default_factory=dict)
    gloo_text: str = ""
    gloo: Callable[[Sizes, float], float] | None = None
    paper: str = ""


#: The configurations, in the order they run and print. hpZ and qgZ are one more entry each.
CONFIGS = [
    Config("zero1", "ZeRO-1 flat", "lz", dict(stage=1), "RS + AG: b Psi (1/4 + a)", _zero12, "2.0 Psi b"),
    Config("zero2", "ZeRO-2 flat", "lz", dict(stage=2), "b Psi (1/4 + a)", _zero12, "2.0 Psi b"),
    Config("zero3", "ZeRO-3 flat", "lz", dict(stage=3), "b (a (2 Psi_u - Psi_l + Psi_r) + Psi/4)", _zero3,
           "3.0 Psi b"),
    Config("zero1_hybrid", "ZeRO-1 hybrid (shard_group_size=2)", "lz", dict(stage=1, shard_group_size=NODE),
           "b Psi/2: replica all-reduce of the shard", _replica_allreduce, "2 (R-1)/R Psi b / K"),
    Config("zero2_hybrid", "ZeRO-2 hybrid (shard_group_size=2)", "lz", dict(stage=2, shard_group_size=NODE),
           "b Psi/2", _replica_allreduce, "2 (R-1)/R Psi b / K"),
    Config("zero3_hybrid", "ZeRO-3 hybrid (shard_group_size=2)", "lz", dict(stage=3, shard_group_size=NODE),
           "b Psi/2", _replica_allreduce, "2 (R-1)/R Psi b / K"),
    Config("zero3_qwz", "ZeRO-3 flat + qwZ (quantize_weights)", "lz", dict(stage=3, quantize_weights=True),
           "a (1 + 4/4096)(2 Psi_u - Psi_l + Psi_r) + b Psi/4", lambda s, ag: _zero3(s, ag, QWZ_BYTES),
           "(1 + 2/b) Psi b"),
    Config("zero3_hybrid_qwz", "ZeRO-3 hybrid + qwZ", "lz", dict(stage=3, shard_group_size=NODE,
                                                                  quantize_weights=True),
           "b Psi/2", _replica_allreduce, "2 (R-1)/R Psi b / K"),
    Config("zero3_hpz", "ZeRO-3 flat + hpZ (hpz_group_size=2)", "lz", dict(stage=3, hpz_group_size=NODE),
           "b (a Psi + Psi/4)", _zero3_hpz, "2.0 Psi b"),
    Config("zero3_qgz", "ZeRO-3 flat + qgZ (quantize_grads=int4)", "lz", dict(stage=3, quantize_grads="int4"),
           "a b (2 Psi_u - Psi_l + Psi_r) + (1/2 + 4/4096) Psi/4",
           lambda s, ag: ag * s.b * s.gathered + _qgz_reduce(s), "(2 + 1/(2b)) Psi b"),
    Config("zero3_zeropp", "ZeRO-3 flat + qwZ + hpZ + qgZ", "lz",
           dict(stage=3, quantize_weights=True, hpz_group_size=NODE, quantize_grads="int4"),
           "a (1 + 4/4096) Psi + (1/2 + 4/4096) Psi/4",
           lambda s, ag: ag * s.psi * QWZ_BYTES + _qgz_reduce(s), "(1/b + 1/(2b)) Psi b"),
    Config("fsdp2", "FSDP2 flat (1-D mesh of 4)", "fsdp2", dict(mesh=[WORLD]), "not modelled", None, "3.0 Psi b"),
    Config("fsdp2_hsdp", "FSDP2 HSDP (2-D mesh, replicate 2 x shard 2)", "fsdp2", dict(mesh=[WORLD // NODE, NODE]),
           "not modelled", None, "2 (R-1)/R Psi b / K"),
]

#: ``--curves``: (configuration, seed, tolerance of the last-50 mean against the unquantized run of the same seed, None
#: for the unquantized runs themselves, which come first).
CURVES = [
    ("zero3", 1, None),
    ("zero3", 2, None),
    ("zero3_qwz", 1, 0.01),
    ("zero3_qwz", 2, 0.01),
    ("zero3_qgz", 1, 0.02),
    ("zero3_qgz", 2, 0.02),
    ("zero3_zeropp", 1, 0.03),
    ("zero3_zeropp", 2, 0.03),
]
CURVE_STEPS, CURVE_TAIL = 300, 50
#: The curves' peak learning rate: half the bytes runs' (``OPTIMIZER``), where the unquantized runs of different seeds
#: end where the same run would: see [Note: the learning rate of the curves].
CURVE_LR = 1e-3


# ------------------------------------------------------------------------------------------------------ worker


def _batches(model: dict, seed: int, rank: int, count: int, batch: int = BATCH):
    """``count`` batches of ``batch`` windows for ``rank``: random offsets into the corpus, drawn from (seed, step,
    rank), so every configuration of one seed sees the same data."""
    import torch

    from lightning_zero.data.corpus import load_corpus, stdlib_root

    tokens = torch.frombuffer(bytearray(load_corpus(stdlib_root(), 1_000_000)), dtype=torch.uint8).long()
    seq = model["seq_len"]
    out = []
    for step in range(count):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * WORLD + rank)
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=g)
        windows = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
        out.append((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))
    return out


class _Marks:
    """Per step: time at the step's start and end of its bookkeeping; at the two marked steps the sockets and the
    strategy's counters."""

    def __init__(self, marked: tuple[int, ...]) -> None:
        self.marked = marked
        self.entries: list[float] = []
        self.exits: list[float] = []
        self.snapshots: list[dict] = []
        self.losses: list[float] = []

    def step_start(self, step: int, stats=None) -> None:
        from zbench.sockets import own_sockets

        self.entries.append(time.perf_counter())
        if step in self.marked:
            link = _link_bytes()
            if link is not None:  # on an emulated node (benchmarks/nodes.py): the link's counter, not the sockets
                snap = dict(step=step, link=link)
            else:
                snap = dict(step=step, sockets=[s.as_dict() for s in own_sockets(os.getpid())])
            if stats is not None:
                snap.update(cross=stats.cross_group_bytes, total=stats.total_bytes,
                            by_op={op: [s.calls, s.bytes, s.wire_bytes, s.cross_bytes]
                                   for op, s in stats.by_op.items()})
            self.snapshots.append(snap)
        self.exits.append(time.perf_counter())


def _link_bytes() -> int | None:
    """Bytes this node sent on the link to the other emulated node (tests/cluster.py), or None off such a node."""
    path = os.environ.get("LZ_LINK_COUNTER")
    if not path:
        return None
    with open(path) as f:
        return int(f.read())


def _run_lightning(config: Config, spec: dict, batches, marks: _Marks) -> int:
    """lightning_zero (``kind="lz"``) or Lightning's DDP (``"ddp"``) through the Trainer. Under a launcher of several
    nodes (benchmarks/nodes.py: torchrun on emulated nodes) the Trainer takes its nodes and the strategy reads them;
    on one host the strategy counts the ranks as nodes of ``NODE``."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy
    from lightning_zero.models import GPTConfig, LanguageModel

    class Window(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            marks.step_start(batch_idx, getattr(trainer.strategy, "comm_stats", None))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    devices = int(os.environ.get("LOCAL_WORLD_SIZE", WORLD))
    options = dict(config.options)
    if config.kind == "ddp":
        strategy = DDPStrategy()
    else:
        stage = options.pop("stage")
        units = {"units": ("Block",)} if stage == 3 else {}
        nodes = {"node_size": NODE} if devices == WORLD else {}
        strategy = ZeroStrategy(stage, **nodes, **units, **options)
    pl.seed_everything(spec["seed"], verbose=False)
    module = LanguageModel(GPTConfig(**spec["model"]), **spec["optimizer"])
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, num_nodes=WORLD // devices,
                         max_steps=len(batches),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                         callbacks=[Window()])
    import torch

    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))  # a batch an item
    return module.num_parameters


def _run_fsdp2(config: Config, spec: dict, batches, marks: _Marks) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_zero.models import GPTConfig
    from lightning_zero.models.language_model import _next_token_loss, warmup_cosine

    dist.init_process_group("gloo")
    shape = tuple(config.options["mesh"])
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    torch.manual_seed(spec["seed"])
    model = GPTConfig(**spec["model"]).build()
    n_params = sum(p.numel() for p in model.parameters())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    hp = spec["optimizer"]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=hp["lr"], betas=hp["betas"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_cosine(
        step, hp["warmup_steps"], len(batches), hp["min_lr_ratio"]))
    for step, (x, y) in enumerate(batches):
        marks.step_start(step)
        loss = _next_token_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        marks.losses.append(float(loss))
    dist.barrier()
    dist.destroy_process_group()
    return n_params


def worker(spec: dict) -> None:
    """One rank of one configuration: trains, snapshots, writes its record."""
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    config = next((c for c in CONFIGS if c.name == spec["config"]), None)
    if config is None:  # a configuration of another driver (benchmarks/nodes.py): its kind and options
        config = Config(spec["config"], spec["config"], spec["kind"], spec["options"])
    batches = _batches(spec["model"], spec["seed"], rank, spec["steps_total"], spec.get("batch", BATCH))
    marks = _Marks(tuple(spec["marked"]))
    run = _run_fsdp2 if config.kind == "fsdp2" else _run_lightning
    n_params = run(config, spec, batches, marks)
    record = dict(rank=rank, pid=os.getpid(), n_params=n_params, entries=marks.entries, exits=marks.exits,
                  snapshots=marks.snapshots, losses=marks.losses)
    path = spec["out"] + f".rank{rank}.json"
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


# ------------------------------------------------------------------------------------------------------ driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: Config, model: dict, seed: int, steps_total: int, marked: tuple[int, ...], workdir: str,
           timeout: float, lr: float = OPTIMIZER["lr"]) -> dict:
    """Run ``config`` on WORLD fresh processes at peak learning rate ``lr``; their records by rank, and the store's
    port."""
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, f"{config.name}.s{seed}")
    port = _free_port()
    spec = dict(config=config.name, model=model, seed=seed, steps_total=steps_total, marked=list(marked), out=out,
                optimizer=dict(OPTIMIZER, lr=lr))
    procs = []
    t0 = time.time()
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   LOCAL_WORLD_SIZE=str(WORLD), NODE_RANK="0", GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
        log = open(f"{out}.rank{rank}.log", "w")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
    codes = []
    for proc, _ in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, timeout - (time.time() - t0))))
        except subprocess.TimeoutExpired:
            codes.append("timeout")
    for proc, log in procs:
        if proc.poll() is None:
            proc.kill()  # only the ranks this driver started
            proc.wait()
        log.close()
    ranks = {}
    for rank in range(WORLD):
        path = f"{out}.rank{rank}.json"
        if os.path.exists(path) and os.path.getmtime(path) >= t0:
            with open(path) as f:
                ranks[rank] = json.load(f)
    if len(ranks) != WORLD:
        with open(f"{out}.rank0.log") as f:
            tail = [line for line in f.read().splitlines() if line.strip()][-6:]
        raise RuntimeError(f"{config.name} seed {seed} failed, exit codes {codes}: " + " | ".join(tail))
    return dict(ranks=ranks, store_port=port, wall_s=round(time.time() - t0, 1))


def sizes(model: dict) -> Sizes:
    from lightning_zero.models import GPTConfig

    cfg = GPTConfig(**model)
    d = cfg.d_model
    units = cfg.n_layer * (12 * d * d + 13 * d)
    return Sizes(units=units, root=cfg.num_parameters - units, last=units // cfg.n_layer)


def measure_bytes(config: Config, model: dict, warmup: int, steps: int, workdir: str, timeout: float) -> dict:
    """One configuration's bytes per rank and step (strategy's counters and sockets) and step time."""
    from zbench.sockets import Socket, cross_node, sent_per_peer

    run = launch(config, model, 1, warmup + steps + 1, (warmup, warmup + steps), workdir, timeout)
    ranks = run["ranks"]

    def sockets_at(i):
        return {r: [Socket(**s) for s in d["snapshots"][i]["sockets"]] for r, d in ranks.items()}

    sent = sent_per_peer(sockets_at(0), sockets_at(1), run["store_port"])
    cross = cross_node(sent, NODE)
    first, last = warmup, warmup + steps
    per_step = [max(ranks[r]["entries"][i + 1] - ranks[r]["exits"][i] for r in ranks) for i in range(first, last)]
    row = dict(name=config.name, label=config.label, kind=config.kind, wall_s=run["wall_s"],
               socket_cross=[cross[r] / steps for r in sorted(ranks)],
               socket_total=[sum(sent[r].values()) / steps for r in sorted(ranks)],
               retrans=[sum(s["bytes_retrans"] for s in ranks[r]["snapshots"][1]["sockets"])
                        - sum(s["bytes_retrans"] for s in ranks[r]["snapshots"][0]["sockets"]) for r in sorted(ranks)],
               step_s=statistics.median(per_step), step_s_all=per_step,
               losses=[statistics.fmean(ranks[r]["losses"][i] for r in ranks) for i in range(last + 1)])
    if config.kind == "lz":
        snaps = {r: ranks[r]["snapshots"] for r in ranks}
        row["stats_cross"] = [(snaps[r][1]["cross"] - snaps[r][0]["cross"]) / steps for r in sorted(ranks)]
        row["stats_total"] = [(snaps[r][1]["total"] - snaps[r][0]["total"]) / steps for r in sorted(ranks)]
        row["by_op"] = {op: [(v - snaps[0][0]["by_op"].get(op, [0] * 4)[i]) / steps for i, v in enumerate(vals)]
                        for op, vals in snaps[0][1]["by_op"].items()}
    row["n_params"] = ranks[0]["n_params"]
    return row


def curve(config: Config, model: dict, seed: int, steps: int, workdir: str, timeout: float) -> list[float]:
    """The global batch's loss per step (mean over ranks) of one run at ``CURVE_LR``."""
    run = launch(config, model, seed, steps, (), workdir, timeout, CURVE_LR)
    ranks = run["ranks"]
    return [statistics.fmean(ranks[r]["losses"][i] for r in ranks) for i in range(steps)]


# ------------------------------------------------------------------------------------------------------ report


def _kib(x: float) -> str:
    return f"{x / 1024:,.1f}"


def _pct(a: float, b: float) -> str:
    return f"{100 * (a - b) / b:+.2f}%" if b else ("0" if a == 0 else "n/a")


def render_bytes(part: dict) -> list[str]:
    s = Sizes(**part["sizes"])
    base = next((r for r in part["rows"] if r["name"] == "zero3"), None)
    base_cross = statistics.fmean(base["socket_cross"]) if base else None
    lines = [
        f"{part['started']}, `{part['command']}`: {WORLD} CPU ranks over gloo as {WORLD // NODE} nodes x {NODE}, the "
        f"small GPT (Psi = {s.psi:,} parameters: Psi_u = {s.units:,} in the Blocks, Psi_l = {s.last:,} in the last "
        f"Block, Psi_r = {s.root:,} in the root), fp32 (b = {s.b}), {BATCH} x {part['model']['seq_len']} tokens a "
        "rank and step; KiB a rank sends to "
        f"the other node per step, the mean over the 4 ranks of {part['steps']} steps after {part['warmup']} "
        f"warm-up steps; commit {part.get('commit') or 'unknown'}. `a`: the share of the bytes a rank sends across "
        "per all-gather, 1/4 node by node (by_node.py, [Note: hierarchical collectives]).",
        "",
        "| configuration | gloo formula (a = 1/4) | formula | comm_stats | sockets | sockets vs comm_stats | sockets vs "
        "formula | all sent (sockets) | cross / ZeRO-3 | paper (ring) | step ms |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|---|--:|",
    ]
    for r in part["rows"]:
        config = next((c for c in CONFIGS if c.name == r["name"]), None)
        sock = statistics.fmean(r["socket_cross"])
        modelled = config is not None and config.gloo is not None
        formula = config.gloo(s, AG_SHARE) if modelled else None
        stats = statistics.fmean(r["stats_cross"]) if "stats_cross" in r else None
        cells = [
            r["label"], config.gloo_text if config else "", _kib(formula) if modelled else "-",
            _kib(stats) if stats is not None else "-", _kib(sock), _pct(sock, stats) if stats is not None else "-",
            _pct(sock, formula) if modelled else "-",
            _kib(statistics.fmean(r["socket_total"])), f"{sock / base_cross:.3f}" if base_cross else "-",
            config.paper if config else "", f"{1000 * r['step_s']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"| {f['label']} | failed: `{f['error'][-300:]}` |" + " |" * 9 for f in part.get("failed", [])]
    spread = [(r["label"], min(r["socket_cross"]), max(r["socket_cross"])) for r in part["rows"]
              if max(r["socket_cross"]) - min(r["socket_cross"]) > 0.01 * max(1.0, statistics.fmean(r["socket_cross"]))]
    lines += ["", "Step ms: per step the slowest rank's time, the median over the measured steps. The 4 ranks are "
              "single-threaded processes time-slicing the machine's cores (2, shared with other jobs, for the runs "
              "here): the column compares configurations roughly with one another, and says nothing of a cluster, "
              "where the links between nodes are the slow ones.",
              "", "Per rank: " + ("every rank within 1% of the mean." if not spread else "; ".join(
        f"{label} {_kib(lo)}-{_kib(hi)} KiB" for label, lo, hi in spread) + ", every other configuration within "
        "1% of its mean.")]
    return lines


def render_curves(part: dict, png_rel: str | None) -> list[str]:
    lines = [f"{part['started']}, `{part['command']}`: {part['steps']} steps of flat ZeRO-3 on {WORLD} CPU ranks "
             f"(2 nodes x 2), the small GPT, global batch {WORLD * BATCH} x {part['model']['seq_len']} tokens, AdamW "
             f"lr {part.get('lr', OPTIMIZER['lr'])} (warm-up {OPTIMIZER['warmup_steps']}, cosine to {OPTIMIZER['min_lr_ratio']}x); "
             f"mean loss of the last {part['tail']} steps.", ""]
    if png_rel:
        lines += [f"![loss curves, unquantized (two seeds) and quantized]({png_rel})", ""]
    spread, rows = verdicts(part)
    lines += ["| run | seed | last-50 mean loss | vs unquantized (same seed) | within | within 2 x seed spread "
              f"({2 * spread:.4f}) |", "|---|--:|--:|--:|--:|--:|"]
    for row in rows:
        tol = row["tolerance"]
        lines.append(f"| {row['label']} | {row['seed']} | {row['tail']:.4f} | {100 * row['relative']:+.2f}% | "
                     + (f"{100 * tol:.0f}%: {'yes' if row['within_bar'] else 'NO'}" if tol else "-") + " | "
                     + (f"{'yes' if row['within_spread'] else 'NO'}" if tol else "-") + " |")
    return lines


def verdicts(part: dict) -> tuple[float, list[dict]]:
    """The curves' criterion: the spread of the unquantized runs' tails (last-``tail`` means) over their seeds, and
    per run its tail, its offset relative to the unquantized run of its seed, and whether that is within its
    tolerance and within twice the spread (unquantized runs: against the first seed's, no verdict)."""
    runs = part["runs"]
    plain = {run["seed"]: _tail(run, part["tail"]) for run in runs if run.get("tolerance") is None}
    spread = max(plain.values()) - min(plain.values())
    first, rows = min(plain), []
    for run in runs:
        tail, tol = _tail(run, part["tail"]), run.get("tolerance")
        reference = plain.get(run["seed"], plain[first]) if tol else plain[first]
        rows.append(dict(label=run["label"], name=run["name"], seed=run["seed"], tail=tail, tolerance=tol,
                         relative=(tail - reference) / reference,
                         within_bar=tol is not None and abs(tail - reference) <= tol * reference,
                         within_spread=tol is not None and abs(tail - reference) <= 2 * spread))
    return spread, rows


def _tail(run: dict, tail: int) -> float:
    return statistics.fmean(run["losses"][-tail:])


def render(results: dict, png_rel: str | None = None) -> str:
    """The BENCHMARKS.md section's body (report.py adds the heading)."""
    lines: list[str] = []
    if "bytes" in results:
        lines += ["### Bytes that cross nodes per step", ""] + render_bytes(results["bytes"]) + [""]
    if "curves" in results:
        lines += ["### Loss curves of the quantized options", ""] + render_curves(results["curves"], png_rel) + [""]
    return "\n".join(lines)


def plot_curves(part: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax, tail_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    for run in part["runs"]:
        label = f"{run['label']} (seed {run['seed']})"
        ax.plot(run["losses"], label=label, linewidth=1)
        tail_ax.plot(range(len(run["losses"]) - part["tail"], len(run["losses"])), run["losses"][-part["tail"]:],
                     label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch)")
    ax.set_title("loss per step")
    ax.legend(fontsize=8)
    tail_ax.set_xlabel("step")
    tail_ax.set_title(f"last {part['tail']} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------------ main


def _load(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="", help=f"comma list of {', '.join(c.name for c in CONFIGS)} (default: all)")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the first snapshot")
    ap.add_argument("--steps", type=int, default=6, help="steps between the two snapshots")
    ap.add_argument("--curves", action="store_true", help="the loss curves instead (CURVES, 300 steps each)")
    ap.add_argument("--curve-steps", type=int, default=CURVE_STEPS)
    ap.add_argument("--reuse", action="store_true", help="with --curves: keep the runs --results already holds for "
                                                         "the same configuration, seed and steps; run the others")
    ap.add_argument("--quick", action="store_true", help="a tiny model (a check of the script, not a measurement)")
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--workdir", default=os.path.join(ROOT, "bench_work", "zeropp"))
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run (default: 900, with --curves 3600)")
    ap.add_argument("--report-only", action="store_true", help="print the report of --results")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    results = _load(args.results)
    if args.report_only:
        print(render(results))
        return 0
    model = TINY if args.quick else MODEL
    if args.timeout is None:
        args.timeout = 3600.0 if args.curves else 900.0
    command = " ".join(["python benchmarks/zeropp.py", *(argv if argv is not None else sys.argv[1:])])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    by_name = {c.name: c for c in CONFIGS}
    if args.curves:
        runs = []
        kept = {(r["name"], r["seed"]): r["losses"] for r in results.get("curves", {}).get("runs", [])
                if args.reuse and results["curves"]["steps"] == args.curve_steps and results["curves"]["model"] == model
                and results["curves"].get("lr", OPTIMIZER["lr"]) == CURVE_LR}
        for name, seed, tolerance in CURVES:
            t0 = time.time()
            losses = kept.get((name, seed)) or curve(by_name[name], model, seed, args.curve_steps, args.workdir,
                                                     args.timeout)
            runs.append(dict(name=name, label=by_name[name].label, seed=seed, tolerance=tolerance, losses=losses))
            print(f"[zeropp] {name} seed {seed}: last-{CURVE_TAIL} mean {_tail(runs[-1], CURVE_TAIL):.4f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
        results["curves"] = dict(started=started, command=command, model=model, steps=args.curve_steps,
                                 tail=min(CURVE_TAIL, args.curve_steps), lr=CURVE_LR, runs=runs, commit=_commit())
        png = os.path.splitext(args.results)[0] + "_curves.png"
        if not plot_curves(results["curves"], png):
            print("[zeropp] plot skipped: matplotlib is not installed", flush=True)
    else:
        names = [n for n in args.configs.split(",") if n] or list(by_name)
        unknown = [n for n in names if n not in by_name]
        if unknown:
            print(f"[zeropp] unknown configuration {unknown}: allowed {', '.join(by_name)}", file=sys.stderr)
            return 2
        rows, failed = [], []
        for name in names:
            try:
                row = measure_bytes(by_name[name], model, args.warmup, args.steps, args.workdir, args.timeout)
            except RuntimeError as error:
                print(f"[zeropp] {error}", flush=True)
                failed.append(dict(name=name, label=by_name[name].label, error=str(error)[-600:]))
                continue
            rows.append(row)
            print(f"[zeropp] {name}: cross {statistics.fmean(row['socket_cross']) / 1024:,.1f} KiB/rank/step on the "
                  f"sockets, {statistics.fmean(row.get('stats_cross', [0])) / 1024:,.1f} by comm_stats; step "
                  f"{1000 * row['step_s']:.0f} ms ({row['wall_s']:.0f} s)", flush=True)
        results["bytes"] = dict(started=started, command=command, model=model, sizes=vars(sizes(model)),
                                warmup=args.warmup, steps=args.steps, rows=rows, failed=failed, commit=_commit())
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    with open(args.results, "w") as f:
        json.dump(results, f, indent=1)
    print(render(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
