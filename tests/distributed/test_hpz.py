"""hpZ (``hpz_group_size``) on 4 CPU ranks over gloo as 2 nodes x 2, against flat zero3 over the 4: losses, weights and
the clipped gradient norm bitwise equal every step (fp32 and bf16-mixed, with accumulation and activation
checkpointing; 4 x 1 and under hybrid sharding too; with qwZ against ``reshard_after_forward=False``); nothing of the
backward's all-gathers crosses nodes and the bytes per step are flat zero3's with the backward gather moved inside
the node; the secondary shards add exactly ``Psi * b / K2`` bytes per rank at the end of the first forward, as
``estimate.hpz_bytes`` predicts (less the last unit's from then on: it stays gathered for its backward); a resume is
bit-exact and the checkpoint holds nothing new; topologies that do not fit are refused at setup (offload composes:
test_zeropp_offload.py). One fork runs every case (6 ranks as 3 nodes x 2 in another)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_zero import ZeroConfigError, ZeroStrategy, estimate
from lightning_zero.models import GPTConfig, LanguageModel
from lightning_zero.sharding.flat_param import ShardSpec
from tests.harness import run_on_ranks
from tests.models import AdapterModel, ParityModel, Recorder, StepSeededLM, make_trainer, pattern_loader

WORLD, NODE = 4, 2
STEPS = 5
CLIP = 0.05  # below the gradient norm, so every step clips
GPT = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16)
#: Every parameter in a unit but the final LayerNorm's: the secondaries cover all but 2 d of the model.
UNTIED = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16, tie_embeddings=False)
ALL_UNITS = ("Block", "Embedding", "model.lm_head")


class StepLog(pl.Callback):
    """Per optimizer step: each kind of collective's bytes and cross-node bytes within the step, the total and
    cross-node bytes, the clipped norm; and the parameter bytes and secondary shards held at the end of each
    forward. Listed before ``Recorder``, whose gather of the parameters then falls outside the window."""

    def __init__(self) -> None:
        self.ops: list[dict[str, tuple[int, int]]] = []
        self.total: list[int] = []
        self.cross: list[int] = []
        self.norms: list[float] = []
        self.forward_params: list[int] = []
        self.secondaries: list[int] = []

    def _now(self, trainer) -> tuple[dict[str, tuple[int, int]], int, int]:
        stats = trainer.strategy.comm_stats
        ops = {op: (s.bytes, s.cross_bytes) for op, s in stats.by_op.items()}
        return ops, stats.total_bytes, stats.cross_group_bytes

    def on_train_batch_start(self, trainer, *args) -> None:
        self._start = self._now(trainer)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.forward_params.append(trainer.strategy.model_state_bytes().params)
        secondaries = trainer.strategy.runtime.parameters.secondary_shards()
        self.secondaries.append(sum(t.numel() * t.element_size() for t in secondaries))

    def on_train_batch_end(self, trainer, *args) -> None:
        (ops, total, cross), (ops0, total0, cross0) = self._now(trainer), self._start
        self.ops.append({op: (b - ops0.get(op, (0, 0))[0], c - ops0.get(op, (0, 0))[1]) for op, (b, c) in ops.items()})
        self.total.append(total - total0)
        self.cross.append(cross - cross0)
        if not trainer.fit_loop._should_accumulate():
            self.norms.append(float(trainer.strategy.last_grad_norm))


def _patterns(config: GPTConfig) -> DataLoader:
    return pattern_loader(config.vocab_size, config.seq_len, rows=128)


def _fit(hpz: int | None, world: int = WORLD, precision: str = "32-true", config: GPTConfig = GPT,
         units: tuple[str, ...] = ("Block",), accumulate: int = 1, **options) -> dict:
    pl.seed_everything(3, verbose=False)
    model = LanguageModel(config, lr=3e-3, warmup_steps=2)
    log, recorder = StepLog(), Recorder()
    options.setdefault("node_size", NODE)
    strategy = ZeroStrategy(3, units=units, hpz_group_size=hpz, **options)
    trainer = make_trainer(strategy, world, max_steps=STEPS, callbacks=[log, recorder], precision=precision,
                           gradient_clip_val=CLIP, accumulate_grad_batches=accumulate)
    trainer.fit(model, train_dataloaders=_patterns(config))
    units_shapes = [p.shape for name, p in model.model.named_parameters() if name.startswith("blocks.")]
    return {"losses": recorder.losses, "params": recorder.params, "norms": log.norms, "ops": log.ops,
            "total": log.total, "cross": log.cross, "forward_params": log.forward_params,
            "secondaries": log.secondaries, "blocks": units_shapes, "num_params": model.num_parameters,
            "unit_shapes": _unit_shapes(trainer)}


def _unit_shapes(trainer) -> list[list[torch.Size]]:
    """The shapes of each non-root unit's parameters."""
    return [[s.spec.shape for s in unit.shards] for unit in trainer.strategy.runtime.parameters.units]


def _fit_model(name: str, hpz: int | None) -> dict:
    """A module called twice in a forward, a frozen unit whose output needs no gradient and LoRA layers
    (``AdapterModel``); or a layer used on even batches only, with ``find_unused_parameters`` (``ParityModel``)."""
    pl.seed_everything(1234, verbose=False)
    if name == "adapter":
        model, options = AdapterModel(), {"units": ("LoRALinear", "mix", "embed")}
    else:
        model, options = ParityModel("adamw", with_unused=True), {"units": ("Linear",), "find_unused_parameters": True}
    log, recorder = StepLog(), Recorder()
    strategy = ZeroStrategy(3, node_size=NODE, hpz_group_size=hpz, **options)
    trainer = make_trainer(strategy, WORLD, max_steps=STEPS, callbacks=[log, recorder], gradient_clip_val=CLIP)
    trainer.fit(model)
    return {"losses": recorder.losses, "params": recorder.params, "norms": log.norms, "cross": log.cross}


# ---------------------------------------------------------------------------------------------- resume


def _resume(root: Path) -> dict:
    def fit(steps: int, hpz: int | None, ckpt_path=None) -> tuple[pl.Trainer, Recorder]:
        pl.seed_everything(5, verbose=False)
        recorder = Recorder()
        strategy = ZeroStrategy(3, units=("Block",), node_size=NODE, hpz_group_size=hpz)
        trainer = make_trainer(strategy, WORLD, max_steps=steps, callbacks=[recorder], gradient_clip_val=CLIP)
        trainer.fit(StepSeededLM(), ckpt_path=ckpt_path)
        return trainer, recorder

    saved = {}
    for hpz in (None, 2):
        first, _ = fit(3, hpz)
        saved[hpz] = root / f"hpz{hpz}.ckpt"
        first.save_checkpoint(saved[hpz])
    _, whole = fit(6, 2)
    _, resumed = fit(6, 2, ckpt_path=saved[2])
    return {"whole": (whole.losses[3:], whole.params[3:]), "resumed": (resumed.losses, resumed.params),
            "paths": saved}


# ------------------------------------------------------------------------------------------------ config errors


def _setup_error(**options) -> str:
    trainer = make_trainer(ZeroStrategy(3, units=("Block",), **options), WORLD, max_steps=1)
    try:
        trainer.fit(LanguageModel(GPT), train_dataloaders=_patterns(GPT))
    except ZeroConfigError as err:
        return str(err)
    return "no error"


def _run_all(rank: int, world_size: int, root: Path) -> dict:
    out = {"fits": {}}
    fits = out["fits"]
    fits["flat"], fits["hpz"] = _fit(None), _fit(2)
    fits["flat bf16"], fits["hpz bf16"] = _fit(None, precision="bf16-mixed"), _fit(2, precision="bf16-mixed")
    fits["flat accumulate"], fits["hpz accumulate"] = _fit(None, accumulate=2), _fit(2, accumulate=2)
    checkpointing = {"activation_checkpointing_policy": ("Block",)}
    fits["flat checkpointing"], fits["hpz checkpointing"] = _fit(None, **checkpointing), _fit(2, **checkpointing)
    fits["flat 4x1"], fits["hpz 4x1"] = _fit(None, node_size=1), _fit(1, node_size=1)
    fits["flat 1x4"], fits["hpz 1x4"] = _fit(None, node_size=4), _fit(2, node_size=4)
    fits["flat hybrid"], fits["hpz hybrid"] = _fit(None, shard_group_size=2), _fit(1, shard_group_size=2)
    # qwZ: the secondary holds the dequantized weights of the forward, as units kept from forward to backward do.
    fits["flat qwz"] = _fit(None, quantize_weights=True, reshard_after_forward=False)
    fits["hpz qwz"] = _fit(2, quantize_weights=True)
    fits["flat untied"] = _fit(None, config=UNTIED, units=ALL_UNITS)
    fits["hpz untied"] = _fit(2, config=UNTIED, units=ALL_UNITS)
    for name in ("adapter", "unused"):
        fits[f"flat {name}"], fits[f"hpz {name}"] = _fit_model(name, None), _fit_model(name, 2)
    out["resume"] = _resume(root)
    out["errors"] = [_setup_error(hpz_group_size=3), _setup_error(hpz_group_size=4)]
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("hpz")
    return run_on_ranks(lambda r, w: _run_all(r, w, root), WORLD)


# -------------------------------------------------------------------------------------------------------- tests


def _assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert len(got["params"]) == len(want["params"]) == STEPS, what
    assert got["losses"] == want["losses"], what
    for step, (g, w) in enumerate(zip(got["params"], want["params"])):
        assert torch.equal(g, w), f"{what}: step {step}"
    assert got["norms"] == want["norms"], what
    assert not torch.equal(got["params"][0], got["params"][-1]), what
    assert min(want["norms"]) > CLIP, what  # every step clipped


@pytest.mark.parametrize("case", ["", " bf16", " accumulate", " checkpointing", " 4x1", " hybrid", " qwz",
                                  " untied", " adapter", " unused", " 1x4"])
def test_hpz_is_bitwise_the_flat_stage_every_step(ranks, case: str) -> None:
    """hpZ against the same run without it: flat zero3 gathers the same rows of the same shards again in backward;
    under qwZ units kept from forward to backward (``reshard_after_forward=False``) compute with the same values."""
    for rank, out in enumerate(ranks):
        _assert_bitwise(out["fits"][f"hpz{case}"], out["fits"][f"flat{case}"], f"rank {rank}{case}")


def _segment(shapes, n: int) -> int:
    """Elements of one rank's segment of a buffer of these parameters sharded ``n`` ways (rows padded)."""
    return sum(ShardSpec(torch.Size(shape), 0, n).padded_numel for shape in shapes)


def _backward_gathered(out: dict) -> list[torch.Size]:
    """The shapes of the parameters backward gathers again in a steady step: every unit's but the last one the
    forward ran (the last block here), which is kept gathered from its forward to its backward."""
    return [shape for shapes in out["unit_shapes"][:-1] for shape in shapes]


@pytest.mark.parametrize(("case", "b"), [("", 4), (" bf16", 2), (" checkpointing", 4)])
def test_backward_gathers_stay_inside_the_node(ranks, case: str, b: int) -> None:
    """2 nodes x 2 on gloo. Each block's backward gather moves inside the node: a rank sends its row of the unit's
    storage (``4 S / 2`` elements, S a rank's segment of the blocks backward gathers) to its one node peer, none of
    it across. Flat
    zero3's backward gather, node by node (by_node.py, [Note: hierarchical collectives]), sent 3 segments (``3 S
    b``), one of them to the other node: hpZ's total is flat's less ``S b``, its cross-node bytes flat's less ``S b``,
    every step. Activation checkpointing's recomputation reuses the backward's gather."""
    for rank, out in enumerate(ranks):
        flat, hpz = out["fits"][f"flat{case}"], out["fits"][f"hpz{case}"]
        s = _segment(_backward_gathered(hpz), WORLD)
        for step in range(1, STEPS):  # steady steps
            assert hpz["ops"][step]["all_gather_hpz"] == (2 * s * b, 0), (rank, step)
            assert hpz["ops"][step]["all_gather"][0] == flat["ops"][step]["all_gather"][0] - 3 * s * b
            assert hpz["total"][step] == flat["total"][step] - s * b, (rank, step)
            assert hpz["cross"][step] == flat["cross"][step] - s * b, (rank, step)


def test_1x4_nothing_crosses(ranks) -> None:
    """One node of 4 ranks, hpZ groups of 2 inside it: nothing crosses either way; hpZ moves flat's less ``S b``."""
    for out in ranks:
        flat, hpz = out["fits"]["flat 1x4"], out["fits"]["hpz 1x4"]
        assert flat["cross"] == hpz["cross"] == [0] * STEPS
        assert hpz["total"][1] == flat["total"][1] - _segment(_backward_gathered(hpz), WORLD) * 4


def test_4x1_backward_gathers_move_nothing(ranks) -> None:
    """Every rank its own node, ``hpz_group_size=1``: the secondary is the whole unit, gathered from nothing."""
    for out in ranks:
        flat, hpz = out["fits"]["flat 4x1"], out["fits"]["hpz 4x1"]
        s = _segment(_backward_gathered(hpz), WORLD)
        assert "all_gather_hpz" not in hpz["ops"][1]
        assert hpz["total"][1] == flat["total"][1] - 3 * s * 4
        assert hpz["cross"][1] == flat["cross"][1] - 3 * s * 4


@pytest.mark.parametrize(("case", "b", "k2"), [("", 4, 2), (" bf16", 2, 2), (" untied", 4, 2), (" 4x1", 4, 1)])
def test_secondaries_add_psi_b_over_k2_per_rank_at_the_end_of_the_forward(ranks, case: str, b: int, k2: int) -> None:
    """What ``model_state_bytes`` counts at the end of each forward: the flat run's parameter bytes plus, per unit,
    ``b`` times its gathered buffer (every rank's padded segment) over ``K2``. With every parameter in a unit but a
    LayerNorm's (untied), that is ``estimate.hpz_bytes`` within 2%. From the second step the last unit the forward
    ran keeps no secondary: it stays gathered for its backward."""
    for out in ranks:
        flat, hpz = out["fits"][f"flat{case}"], out["fits"][f"hpz{case}"]
        per_unit = [b * WORLD * _segment(shapes, WORLD) // k2 for shapes in hpz["unit_shapes"]]
        added = [sum(per_unit)] + [sum(per_unit[:-1])] * (STEPS - 1)
        assert len(flat["losses"]) == STEPS
        assert [h - f for h, f in zip(hpz["forward_params"], flat["forward_params"])] == added
        assert hpz["secondaries"] == added
        assert flat["secondaries"] == [0] * STEPS
        if case == " untied":
            predicted = estimate.hpz_bytes(hpz["num_params"], "32-true", k2)
            assert added[0] == pytest.approx(predicted, rel=0.02)


def test_resume_is_bit_exact_and_the_checkpoint_holds_nothing_new(ranks) -> None:
    for out in ranks:
        (losses, params), (resumed_losses, resumed_params) = out["resume"]["whole"], out["resume"]["resumed"]
        assert resumed_losses == losses and len(params) == 3
        assert all(torch.equal(got, want) for got, want in zip(resumed_params, params))
    paths = ranks[0]["resume"]["paths"]
    flat, hpz = (torch.load(paths[k], mmap=True, weights_only=True) for k in (None, 2))
    assert sorted(hpz) == sorted(flat)
    assert hpz["lightning_zero"]["tensors"] == flat["lightning_zero"]["tensors"]
    assert paths[2].stat().st_size == paths[None].stat().st_size


def test_an_hpz_group_that_does_not_fit_the_shard_group_fails_at_setup(ranks) -> None:
    for out in ranks:
        indivisible, whole = out["errors"]
        assert indivisible == ("hpz_group_size=3 is invalid for a shard group of 4 ranks (world 4): it must divide "
                               "the shard group size and be smaller (allowed: 1, 2)")
        assert whole.startswith("hpz_group_size=4 is invalid for a shard group of 4 ranks")


@pytest.mark.parametrize(("options", "message"), [
    ({"stage": 2}, r"^hpz_group_size=2 needs stage=3"),
    ({"reshard_after_forward": False}, r"^hpz_group_size=2 with reshard_after_forward=False"),
    ({"shard_group_size": 2}, r"^hpz_group_size=2 is invalid with shard_group_size=2"),
    ({"shard_group_size": 6, "hpz_group_size": 4}, r"^hpz_group_size=4 is invalid with shard_group_size=6"),
    ({"hpz_group_size": 0}, r"^hpz_group_size=0 is invalid"),
])
def test_what_does_not_compose_is_refused_up_front(options: dict, message: str) -> None:
    options = {"stage": 3, "hpz_group_size": 2} | options
    with pytest.raises(ZeroConfigError, match=message):
        ZeroStrategy(**options)


def test_offload_composes() -> None:
    """Each offload is accepted (tests/distributed/test_zeropp_offload.py trains with them)."""
    for offload in ("cpu", "disk"):
        strategy = ZeroStrategy(3, hpz_group_size=2, offload_optimizer=offload, offload_params=offload)
        assert strategy.config.topology.hpz_group_size == 2


# ------------------------------------------------------------------------------------------------- six ranks


def _six(rank: int, world_size: int) -> dict:
    return {"flat": _fit(None, world=world_size), "hpz": _fit(2, world=world_size)}


def test_six_ranks_as_three_nodes_of_two() -> None:
    """Flat zero3 over 6 ranks, 3 nodes x 2: hpZ is bitwise the same, and its backward gathers cross nothing (flat's,
    node by node, sent 5 segments, 2 of them across: its own to the rank at its position on each other node)."""
    six = run_on_ranks(_six, 6)
    for rank, out in enumerate(six):
        _assert_bitwise(out["hpz"], out["flat"], f"rank {rank}")
        s = _segment(_backward_gathered(out["hpz"]), 6)
        across = 2
        for step in range(1, STEPS):
            assert out["hpz"]["ops"][step]["all_gather_hpz"] == (6 * s * 4 // 2, 0)
            assert out["hpz"]["cross"][step] == out["flat"]["cross"][step] - across * s * 4
