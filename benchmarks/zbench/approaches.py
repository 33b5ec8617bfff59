"""The approaches under test and how each builds one training step of the same model, data and optimizer.

Two ways of running a step:

- *loop* approaches are driven by a plain Python loop, as their own documentation shows them: ``fwd_bwd(x, y)``
  (forward and backward), then ``step()`` (optimizer step and zeroing of gradients).
- *lightning* approaches run ``Trainer.fit`` in the same worker processes (the process group already exists, and the
  ``LOCAL_RANK``/``WORLD_SIZE`` environment makes Lightning treat the job as externally launched). Plain Lightning
  DDP runs the same path, so that lightning_zero is compared with both the raw loops and the Trainer it plugs into.

Shared settings, so that differences come from the algorithms: fp32 everywhere, AdamW with the same hyper-parameters
(torch's implementation, except DeepSpeed's CPU-offload variants, which require DeepSpeedCPUAdam), 25 MiB
communication buckets (DDP's default ``bucket_cap_mb``, lightning_zero's ``bucket_mb``, DeepSpeed's
``reduce_bucket_size``/``allgather_bucket_size`` set to the same bytes: its defaults are 500M elements, 2 GB), no
gradient clipping (DeepSpeed 0.19 clips to 1.0 unless told), every parameter sharded at stage 3 (DeepSpeed's
``stage3_param_persistence_threshold=0``; FSDP2 and lightning_zero shard everything), one stage-3 unit per transformer
``Block`` plus the root. DDP registers torch's stock ``allreduce_hook`` so its all-reduces are counted in Python
(see measure.py), ``gradient_as_bucket_view=True`` (no second copy of the gradients).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

BUCKET_MB = 25.0
BUCKET_ELEMENTS = int(BUCKET_MB * 2**20 / 4)  # fp32


@dataclass(frozen=True)
class Approach:
    name: str
    label: str
    kind: str  # "loop" | "lightning"
    family: str  # what it shards, for like-for-like comparisons: none | zero1 | zero2 | zero3 | zero3-noreshard
    distributed: bool = True
    needs: tuple[str, ...] = ()  # optional packages
    offload: bool = False
    note: str = ""
    options: dict = field(default_factory=dict)
    #: torch.compile with inductor (issue 39): "blocks" compiles each transformer Block in place (``block.compile()``,
    #: before any wrapping, as torchtitan compiles FSDP2's blocks), "model" the whole model; ``None``: eager.
    compiled: str | None = None
    #: Lightning's ``EMAWeightAveraging`` in the Trainer's callbacks (issue 39: what the average costs per rank).
    ema: bool = False


APPROACHES: dict[str, Approach] = {
    a.name: a
    for a in [
        Approach("single", "plain loop, 1 process", "loop", "none", distributed=False,
                 note="no process group, no wrapper: the world-size-1 reference"),
        Approach("lit_single", "Lightning, 1 device", "lightning", "none", distributed=False,
                 note="Trainer(strategy='auto', devices=1): the Trainer's own per-step cost"),
        Approach("ddp", "torch DDP", "loop", "none"),
        Approach("lit_ddp", "Lightning DDP", "lightning", "none", note="DDPStrategy through the same Trainer path"),
        Approach("lit_fsdp2", "Lightning FSDP2 (ModelParallelStrategy)", "lightning", "zero3",
                 note="ModelParallelStrategy, fully_shard per Block + root in configure_model, as its docs show"),
        Approach("torch_zero1", "DDP + ZeroRedundancyOptimizer", "loop", "zero1"),
        Approach("fsdp2_noreshard", "FSDP2 reshard_after_forward=False", "loop", "zero3-noreshard",
                 note="fully_shard per Block + root; keeps params gathered from forward to backward"),
        Approach("fsdp2", "FSDP2 reshard_after_forward=True", "loop", "zero3",
                 note="fully_shard per Block + root"),
        Approach("ds_z1", "DeepSpeed ZeRO-1", "loop", "zero1", needs=("deepspeed",)),
        Approach("ds_z2", "DeepSpeed ZeRO-2", "loop", "zero2", needs=("deepspeed",)),
        Approach("ds_z3", "DeepSpeed ZeRO-3", "loop", "zero3", needs=("deepspeed",)),
        Approach("ds_z1_off", "DeepSpeed ZeRO-1 + CPU offload", "loop", "zero1", needs=("deepspeed",), offload=True),
        Approach("ds_z2_off", "DeepSpeed ZeRO-2 + CPU offload", "loop", "zero2", needs=("deepspeed",), offload=True),
        Approach("ds_z3_off", "DeepSpeed ZeRO-3 + CPU offload", "loop", "zero3", needs=("deepspeed",), offload=True),
        Approach("lz_zero1", "lightning_zero zero1", "lightning", "zero1", options=dict(stage=1)),
        Approach("lz_zero2", "lightning_zero zero2", "lightning", "zero2", options=dict(stage=2)),
        Approach("lz_zero1_packed", "lightning_zero zero1 inplace_mb=None", "lightning", "zero1",
                 options=dict(stage=1, inplace_mb=None),
                 note="every parameter packed into bucket buffers: fewer, larger collectives"),
        Approach("lz_zero2_packed", "lightning_zero zero2 inplace_mb=None", "lightning", "zero2",
                 options=dict(stage=2, inplace_mb=None),
                 note="every parameter packed into bucket buffers: fewer, larger collectives"),
        Approach("lz_zero3", "lightning_zero zero3", "lightning", "zero3", options=dict(stage=3)),
        Approach("lz_zero1_offload", "lightning_zero zero1_offload", "lightning", "zero1", offload=True,
                 options=dict(stage=1, offload_optimizer="cpu")),
        Approach("lz_zero2_offload", "lightning_zero zero2_offload", "lightning", "zero2", offload=True,
                 options=dict(stage=2, offload_optimizer="cpu")),
        Approach("lz_zero3_offload", "lightning_zero zero3_offload", "lightning", "zero3", offload=True,
                 options=dict(stage=3, offload_optimizer="cpu")),
        Approach("lz_zero3_offload_disk", "lightning_zero zero3_offload_disk", "lightning", "zero3", offload=True,
                 options=dict(stage=3, offload_optimizer="disk", offload_params="disk"),
                 note="optimizer states, masters and parameter shards in files under offload_dir"),
        *(Approach(f"lz_zero{s}_lean", f"lightning_zero zero{s} lean_memory=True", "lightning", f"zero{s}",
                   options=dict(stage=s, lean_memory=True), note="holding what the formulas say between steps, as "
                   "the defaults do where the model states are over an eighth of the memory budget")
          for s in (1, 2, 3)),
        Approach("lz_zero3_noreshard", "lightning_zero zero3 reshard_after_forward=False", "lightning",
                 "zero3-noreshard", options=dict(stage=3, reshard_after_forward=False)),
        Approach("ddp_compiled", "torch DDP, blocks compiled", "loop", "none", compiled="blocks"),
        Approach("fsdp2_compiled", "FSDP2 reshard_after_forward=True, blocks compiled", "loop", "zero3",
                 compiled="blocks", note="fully_shard per compiled Block + root"),
        Approach("lz_zero3_compiled", "lightning_zero zero3, blocks compiled", "lightning", "zero3",
                 options=dict(stage=3), compiled="blocks"),
        Approach("lz_zero3_compiled_model", "lightning_zero zero3, model compiled", "lightning", "zero3",
                 options=dict(stage=3), compiled="model",
                 note="model.compile(): the graph ends at every unit's hooks"),
        Approach("lit_ddp_ema", "Lightning DDP + EMA", "lightning", "none", ema=True),
        Approach("lz_zero3_ema", "lightning_zero zero3 + EMA", "lightning", "zero3", options=dict(stage=3), ema=True),
        Approach("lz_zero3_offload_ema", "lightning_zero zero3_offload + EMA", "lightning", "zero3", offload=True,
                 options=dict(stage=3, offload_optimizer="cpu"), ema=True),
    ]
}

LIGHTNING_ZERO = [n for n in APPROACHES if n.startswith("lz_")]


def missing_packages(approach: Approach) -> list[str]:
    import importlib.util

    return [pkg for pkg in approach.needs if importlib.util.find_spec(pkg) is None]


# ----------------------------------------------------------------------------------------------------------------------
# loop approaches
# ----------------------------------------------------------------------------------------------------------------------
class LoopRun:
    """One rank's training step of a loop approach, and what to count as its parameters and optimizer."""

    def __init__(self, fwd_bwd, step, params, optimizers, extra_params=(), label_roots=None, info=None) -> None:
        self.fwd_bwd = fwd_bwd
        self.step = step
        self.params = params  # callable -> parameters of the (wrapped) model
        self.optimizers = optimizers  # torch optimizers whose state is model state
        self.extra_params = extra_params  # callable -> storage holding parameters outside module.parameters()
        self.label_roots = label_roots or {}
        self.info = info or {}


def import_for(approach: Approach) -> None:
    """Import what any approach needs, and load what torch loads lazily on a first training step, before the
    baseline RSS is taken: "peak RSS above base" is then what the model and its training cost, not which libraries
    an approach happens to import (lightning alone is ~90 MB). DeepSpeed is imported only by its own runs."""
    import torch
    import torch.nn.functional as F
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.optim  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import lightning.pytorch  # noqa: F401

    import lightning_zero  # noqa: F401

    if approach.name.startswith("ds_"):
        import deepspeed  # noqa: F401
    layer = torch.nn.Linear(8, 24)
    opt = torch.optim.AdamW(layer.parameters())
    q = layer(torch.randn(1, 4, 8)).view(1, 4, 3, 2, 4).permute(2, 0, 3, 1, 4)
    F.scaled_dot_product_attention(q[0], q[1], q[2], is_causal=True).sum().backward()
    opt.step()


def init_process_group(approach: Approach) -> None:
    import torch.distributed as dist

    if approach.name.startswith("ds_"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")


def build_loop(approach: Approach, model, batch: int) -> LoopRun:
    import torch

    from zbench.model import OPTIMIZER, make_optimizer

    name = approach.name.removesuffix("_compiled")  # compiled in place before (worker.py): wrapped the same way

    def plain(module, opt):
        def fwd_bwd(x, y):
            loss = module(x, y)
            loss.backward()
            return loss

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        return fwd_bwd, step

    if name == "single":
        opt = make_optimizer(model.parameters())
        return LoopRun(*plain(model, opt), params=model.parameters, optimizers=[opt])

    if name in ("ddp", "torch_zero1"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=BUCKET_MB)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        if name == "ddp":
            opt = make_optimizer(ddp.parameters())
            inner = opt
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **OPTIMIZER)
            inner = opt.optim
        return LoopRun(*plain(ddp, opt), params=model.parameters, optimizers=[inner])

    if name.startswith("fsdp2"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        reshard = name == "fsdp2"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = make_optimizer(model.parameters())
        return LoopRun(*plain(model, opt), params=model.parameters, optimizers=[opt])

    if name.startswith("ds_"):
        return _build_deepspeed(approach, model, batch)

    raise ValueError(f"{name} is not a loop approach")


def _build_deepspeed(approach: Approach, model, batch: int) -> LoopRun:
    import deepspeed

    from zbench.model import OPTIMIZER, make_optimizer

    stage = int(approach.name[4])
    zero: dict = {"stage": stage, "reduce_bucket_size": BUCKET_ELEMENTS, "allgather_bucket_size": BUCKET_ELEMENTS}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
    }
    if approach.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        # Offload requires DeepSpeed's own CPU Adam (torch's AdamW is refused); AdamW mode, same hyper-parameters.
        config["optimizer"] = {"type": "AdamW", "params": {**OPTIMIZER, "betas": list(OPTIMIZER["betas"])}}
        client = None
    else:
        client = make_optimizer(model.parameters())
    engine, zero_opt, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)
    inner = getattr(zero_opt, "optimizer", None)

    def fwd_bwd(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    def step():
        engine.step()  # also zeroes the gradients

    def ds_partitions():
        return [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]

    return LoopRun(
        fwd_bwd, step, params=engine.module.parameters, optimizers=[o for o in (inner, zero_opt) if o is not None],
        extra_params=ds_partitions, label_roots={"engine": engine, "zero_opt": zero_opt},
        info={"optimizer": f"{type(zero_opt).__name__}({type(inner).__name__})"},
    )


# ----------------------------------------------------------------------------------------------------------------------
# lightning approaches
# ----------------------------------------------------------------------------------------------------------------------
def make_strategy(approach: Approach, world: int):
    if approach.name == "lit_single":
        return "auto"
    if approach.name.startswith("lit_ddp"):
        from lightning.pytorch.strategies import DDPStrategy

        # The comm hook is registered by worker.py (Lightning registers hooks only on CUDA).
        return DDPStrategy(gradient_as_bucket_view=True, bucket_cap_mb=BUCKET_MB)
    if approach.name == "lit_fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    from lightning_zero import ZeroStrategy

    return ZeroStrategy(bucket_mb=BUCKET_MB, **block_units(approach), **approach.options)


def block_units(approach: Approach) -> dict:
    """Stage 3 gathers each ``Block`` as a unit; stages 1 and 2 refuse the option (they gather no units)."""
    return {"units": ("Block",)} if approach.options.get("stage") == 3 else {}


def extra_callbacks(approach: Approach) -> list:
    """Lightning callbacks the approach trains with, besides the benchmark's own."""
    if not approach.ema:
        return []
    from lightning.pytorch.callbacks import EMAWeightAveraging

    return [EMAWeightAveraging(decay=0.999)]


def lightning_env_ok() -> bool:
    return "LOCAL_RANK" in os.environ
