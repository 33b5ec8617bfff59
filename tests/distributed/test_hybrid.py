"""Hybrid sharding (``shard_group_size``) on 4 CPU ranks as 2 nodes x 2, against flat sharding over the 4: the same
losses, weights and clipped gradient norm every step for stages 1-3; checkpoints saved under one topology resume
under the other, each row written once; the bytes that cross nodes per step, exactly as the model of each algorithm
in sharding/topology.py ([Note: what crosses nodes]) says; topologies that do not fit the world refused at setup.
One fork runs every case."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import lightning_zero.checkpoint.sharded as sharded_module
from lightning_zero import ZeroConfigError, ZeroStrategy
from lightning_zero.checkpoint import consolidate
from lightning_zero.sharding.flat_param import ShardSpec
from tests.distributed.test_nonfinite import BAD_STEP, NonFiniteOnRank1
from tests.harness import run_on_ranks
from tests.models import ParityModel, Recorder, StepSeededLM, TinyLM, flat_params, make_trainer

WORLD, K, NODE = 4, 2, 2
STEPS = 6
CLIP = 0.05  # below the gradient norm, so every step clips
TOL = dict(rtol=1e-6, atol=1e-6)


#: Offload options by name, and the stage each runs at (their strategies' names without the stage).
OFFLOAD = {"offload": {"offload_optimizer": "cpu"}, "offload_disk": {"offload_optimizer": "disk", "offload_params": "disk"}}
OFFLOADED = [("offload", 2), ("offload", 3), ("offload_disk", 3)]

#: Shard group sizes by name: flat over the 4 ranks (as 2 nodes), hybrid 2 x 2, and 4 x 1 (every state replicated).
GROUPS = {"flat": None, "2x2": K, "4x1": 1}


def strategy(stage: int, hybrid: bool | str, **options) -> ZeroStrategy:
    """Flat (``False``), hybrid 2 x 2 (``True``), or a topology of ``GROUPS`` by name."""
    units = {"units": ("Block",)} if stage == 3 else {}  # ParityModel's layer used on one rank sits in the root unit
    group = GROUPS[hybrid] if isinstance(hybrid, str) else (K if hybrid else None)
    topology = {"shard_group_size": group} if group else {"node_size": NODE}
    return ZeroStrategy(stage, **topology, **units, **options)


class StepLog(pl.Callback):
    """Per optimizer step: the bytes this rank moved and sent across nodes within the step, and the clipped norm.
    Listed before ``Recorder``, whose gather of the parameters (stage 3) then falls outside the window."""

    def __init__(self) -> None:
        self.total: list[int] = []
        self.cross: list[int] = []
        self.norms: list[float] = []

    def on_train_batch_start(self, trainer, *args) -> None:
        stats = trainer.strategy.comm_stats
        self._start = (stats.total_bytes, stats.cross_group_bytes)

    def on_train_batch_end(self, trainer, *args) -> None:
        stats = trainer.strategy.comm_stats
        self.total.append(stats.total_bytes - self._start[0])
        self.cross.append(stats.cross_group_bytes - self._start[1])
        self.norms.append(float(trainer.strategy.last_grad_norm))
        self.held = trainer.strategy.model_state_bytes()


def _fit(stage: int, hybrid: str, precision: str = "32-true", **options) -> dict:
    pl.seed_everything(1234, verbose=False)
    model, log, recorder = TinyLM(), StepLog(), Recorder()
    trainer = make_trainer(strategy(stage, hybrid, **options), WORLD, max_steps=STEPS, callbacks=[log, recorder],
                           gradient_clip_val=CLIP, precision=precision)
    trainer.fit(model)
    blocks = [p for block in model.lm["blocks"] for p in block.parameters()]
    root = [p for p in model.parameters() if all(p is not b for b in blocks)]
    after_fit = flat_params(model)
    return {"losses": recorder.losses, "params": recorder.params, "norms": log.norms, "cross": log.cross,
            "total": log.total, "shapes": ([p.shape for p in blocks], [p.shape for p in root]),
            "last_block": [p.shape for p in model.lm["blocks"][-1].parameters()],
            "after_fit": after_fit, "validate": trainer.validate(model, verbose=False)[0]["val_loss"], "held": log.held}


# --------------------------------------------------------------------------------------------------- checkpoints


def _checkpoint_fit(hybrid: bool, steps: int, ckpt_path=None, **options) -> tuple[pl.Trainer, Recorder]:
    pl.seed_everything(5, verbose=False)
    recorder = Recorder()
    trainer = make_trainer(strategy(3, hybrid, **options), WORLD, max_steps=steps, callbacks=[recorder])
    trainer.fit(StepSeededLM(), ckpt_path=ckpt_path)
    return trainer, recorder


def _counting_writes(written: list[int]):
    original = sharded_module.write_rows

    def write_rows(fd, offset, tensor):
        written.append(tensor.numel() * tensor.element_size())
        return original(fd, offset, tensor)

    return original, write_rows


def _checkpoints(root: Path) -> dict:
    out = {}
    for saved_hybrid in (True, False):
        path = root / f"hybrid{int(saved_hybrid)}.ckpt"
        first, _ = _checkpoint_fit(saved_hybrid, 5)
        written: list[int] = []
        original, counting = _counting_writes(written)
        sharded_module.write_rows = counting
        try:
            first.save_checkpoint(path)
        finally:
            sharded_module.write_rows = original
        _, whole = _checkpoint_fit(not saved_hybrid, 10)
        _, resumed = _checkpoint_fit(not saved_hybrid, 10, ckpt_path=path)
        out[saved_hybrid] = {"written": sum(written), "whole": (whole.losses[5:], whole.params[5:]),
                             "resumed": (resumed.losses, resumed.params), "path": path}
    _, whole = _checkpoint_fit(True, 10)
    _, resumed = _checkpoint_fit(True, 10, ckpt_path=root / "hybrid1.ckpt")
    out["same"] = {"whole": (whole.losses[5:], whole.params[5:]), "resumed": (resumed.losses, resumed.params)}
    disk = OFFLOAD["offload_disk"]
    first, _ = _checkpoint_fit(True, 5, **disk)
    first.save_checkpoint(root / "hybrid_disk.ckpt")
    _, whole = _checkpoint_fit(True, 10, **disk)
    _, resumed = _checkpoint_fit(True, 10, ckpt_path=root / "hybrid_disk.ckpt", **disk)
    _, flat = _checkpoint_fit(False, 10, ckpt_path=root / "hybrid_disk.ckpt")
    # Flat over 4 ranks: a rank holds no rows of the smallest parameter (its state is in memory, not in a file).
    first, _ = _checkpoint_fit(False, 5, **disk)
    first.save_checkpoint(root / "flat_disk.ckpt")
    _, flat_whole = _checkpoint_fit(False, 10, **disk)
    _, flat_resumed = _checkpoint_fit(False, 10, ckpt_path=root / "flat_disk.ckpt", **disk)
    out["disk"] = {"whole": (whole.losses[5:], whole.params[5:]), "resumed": (resumed.losses, resumed.params),
                   "flat": (flat.losses, flat.params), "flat_whole": (flat_whole.losses[5:], flat_whole.params[5:]),
                   "flat_resumed": (flat_resumed.losses, flat_resumed.params)}
    return out


# --------------------------------------------------------------------- accumulation, a parameter used on one rank


class UsedOnRank3(ParityModel):
    """A layer only rank 3 (replica 1) uses, on even batches: with ``find_unused_parameters`` every rank of both
    replicas must agree that it was used, or the replicas would step different parameters."""

    def __init__(self) -> None:
        super().__init__("adamw", with_unused=True)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self(tokens, use_sometimes=self.global_rank == 3 and batch_idx % 2 == 0)
        return nn.functional.cross_entropy(logits, targets)


def _variant(name: str, stage: int, hybrid: bool | None) -> dict:
    """``hybrid=None``: the same under DDP."""
    pl.seed_everything(11, verbose=False)
    recorder = Recorder()
    if name == "accumulate":
        model, options, settings = TinyLM(), {}, {"accumulate_grad_batches": 2}
    else:
        model, options, settings = UsedOnRank3(), {"find_unused_parameters": True}, {}
    chosen = DDPStrategy(**options) if hybrid is None else strategy(stage, hybrid, **options)
    trainer = make_trainer(chosen, WORLD, max_steps=4, callbacks=[recorder], **settings)
    trainer.fit(model)
    checked = trainer.strategy.check_replicas() if hybrid is not None else 1
    return {"losses": recorder.losses, "params": recorder.params, "replicas": checked}


# ------------------------------------------------------------------------------------------- non-finite gradients


def _nonfinite(stage: int, hybrid: bool) -> dict:
    """Rank 1 (shard group 0) gets a NaN at step ``BAD_STEP``: with ``nonfinite_grads="skip"`` every rank of both
    replicas skips that step, once."""
    pl.seed_everything(7, verbose=False)
    recorder = Recorder()
    trainer = make_trainer(strategy(stage, hybrid, nonfinite_grads="skip"), WORLD, max_steps=4, callbacks=[recorder])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(NonFiniteOnRank1(float("nan")))
    return {"params": recorder.params, "skipped": trainer.strategy.runtime.skipped_steps,
            "replicas": trainer.strategy.check_replicas()}


# ------------------------------------------------------------------------------------------------ config errors


def _setup_error(**options) -> str:
    trainer = make_trainer(ZeroStrategy(2, **options), WORLD, max_steps=1)
    try:
        trainer.fit(TinyLM())
    except ZeroConfigError as err:
        return str(err)
    return "no error"


def _run_all(rank: int, world_size: int, root: Path) -> dict:
    out = {"fits": {(stage, name): _fit(stage, name) for stage in (1, 2, 3) for name in GROUPS}}
    out["bf16"] = {name: _fit(3, name, "bf16-mixed")["cross"] for name in ("flat", "2x2")}
    out["offload"] = {(option, name): _fit(stage, name, **OFFLOAD[option])
                      for option, stage in OFFLOADED for name in ("flat", "2x2")}
    out["checkpoints"] = _checkpoints(root)
    variants = [("accumulate", 1), ("accumulate", 2), ("unused", 2), ("unused", 3)]
    out["variants"] = {(name, stage, hybrid): _variant(name, stage, hybrid)
                       for name, stage in variants for hybrid in (False, True)}
    out["variants"]["unused", "ddp"] = _variant("unused", 0, None)
    out["nonfinite"] = {(stage, hybrid): _nonfinite(stage, hybrid) for stage in (2, 3) for hybrid in (False, True)}
    out["errors"] = [_setup_error(shard_group_size=3), _setup_error(node_size=3)]
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("hybrid")
    return run_on_ranks(lambda r, w: _run_all(r, w, root), WORLD)


# -------------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("group", ["2x2", "4x1"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_matches_flat_every_step(ranks, stage: int, group: str) -> None:
    """2 x 2, and 4 x 1 (every state replicated on every rank, the gradients all-reduced as DDP does)."""
    for rank, out in enumerate(ranks):
        flat, hybrid = out["fits"][(stage, "flat")], out["fits"][(stage, group)]
        assert len(hybrid["params"]) == len(flat["params"]) == STEPS
        torch.testing.assert_close(torch.tensor(hybrid["losses"]), torch.tensor(flat["losses"]), **TOL)
        for step, (got, want) in enumerate(zip(hybrid["params"], flat["params"])):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} step {step}: {m}")
        assert not torch.equal(hybrid["params"][0], hybrid["params"][-1])
        # After fit the module holds the full trained weights; a later validate (a second setup) agrees with flat's.
        assert torch.equal(hybrid["after_fit"], hybrid["params"][-1])
        assert hybrid["validate"] == pytest.approx(flat["validate"], rel=1e-6)
        # The norm counted once: a norm summed over both replicas would be sqrt(2) times this.
        torch.testing.assert_close(torch.tensor(hybrid["norms"]), torch.tensor(flat["norms"]), **TOL)
        assert min(flat["norms"]) > CLIP


def _segment(shapes, n: int) -> int:
    """Elements of one rank's segment of a buffer of these parameters sharded ``n`` ways (rows padded)."""
    return sum(ShardSpec(torch.Size(shape), 0, n).padded_numel for shape in shapes)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cross_node_bytes_per_step_match_the_algorithm_model(ranks, stage: int) -> None:
    """2 nodes x 2 ranks, fp32 (b = 4), gloo. Flat: the reduce-scatters and all-gathers run node by node
    (by_node.py, [Note: hierarchical collectives]): each sends one segment across per call, from every rank (its
    node's partial sum of the other node's segment at its position; its own segment); the norm's all-reduce (5
    floats, a ring 0-1-2-3) crosses from ranks 1 and 3. Hybrid: only the replica all-reduce of the gradient shard
    crosses (a ring of 2: the whole segment)."""
    b = 4
    blocks, root = ranks[0]["fits"][(stage, "flat")]["shapes"]
    everything = [*blocks, *root]
    hybrid = b * _segment(everything, K)
    norm_ring = int(2 * (3 / 4) * (1 + WORLD) * 4)
    for rank, out in enumerate(ranks):
        if stage == 3:  # blocks gathered in forward and backward (but the last, kept gathered between them) and
            # reduced; the root unit gathered once and reduced
            last = ranks[0]["fits"][(stage, "flat")]["last_block"]
            flat = b * (3 * _segment(blocks, 4) - _segment(last, 4) + 2 * _segment(root, 4))
        else:  # every gradient reduce-scattered, every parameter all-gathered once
            flat = b * 2 * _segment(everything, 4)
        flat_cross = out["fits"][(stage, "flat")]["cross"][1:]  # steady steps
        hybrid_cross = out["fits"][(stage, "2x2")]["cross"][1:]
        assert flat_cross == [flat + (norm_ring if rank % 2 else 0)] * (STEPS - 1), rank
        assert hybrid_cross == [hybrid] * (STEPS - 1), rank
        # About 2/4 Psi*b (stages 1-2) or up to 3/4 (stage 3: less the last block's backward gather), against
        # Psi*b/2.
        ratio = flat_cross[0] / hybrid_cross[0]
        assert 1.0 < ratio < 1.5 if stage == 3 else ratio == pytest.approx(1.0, rel=0.05)
        if stage == 3:  # bf16-mixed: 16-bit gathers and gradients (b = 2), the norm's all-reduce still fp32
            bf16 = out["bf16"]
            assert bf16["flat"][1:] == [flat // 2 + (norm_ring if rank % 2 else 0)] * (STEPS - 1), rank
            assert bf16["2x2"][1:] == [hybrid // 2] * (STEPS - 1), rank


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_holds_what_flat_sharding_over_one_group_holds(ranks, stage: int) -> None:
    """Each rank holds its rows of a 2-way split (fp32 AdamW: 4 bytes of parameter, 4 of gradient, 8 of moments per
    element of what is sharded) where flat holds those of a 4-way split; everything else is the same."""
    blocks, root = ranks[0]["fits"][(stage, "flat")]["shapes"]
    for rank, out in enumerate(ranks):
        flat, hybrid = out["fits"][(stage, "flat")]["held"], out["fits"][(stage, "2x2")]["held"]
        more = sum(ShardSpec(torch.Size(s), rank % K, K).local_numel - ShardSpec(torch.Size(s), rank, WORLD).local_numel
                   for s in [*blocks, *root])
        assert more > 0
        assert hybrid.params - flat.params == (4 * more if stage == 3 else 0)
        assert hybrid.grads - flat.grads == (4 * more if stage >= 2 else 0)
        assert hybrid.optimizer - flat.optimizer == 8 * more


def test_checkpoint_saved_under_hybrid_sharding_resumes_bit_exact_under_it(ranks) -> None:
    for out in ranks:
        (losses, params), (resumed_losses, resumed_params) = out["checkpoints"]["same"].values()
        assert resumed_losses == losses and len(params) == 5
        assert all(torch.equal(got, want) for got, want in zip(resumed_params, params))


def test_a_checkpoint_of_hybrid_sharding_with_disk_offload_resumes_bit_exact_and_loads_flat(ranks) -> None:
    """Saved after ``fit``, as a user saves a final checkpoint: the optimizer states in the removed offload files
    are still read through their mappings, so the resume is exact."""
    for out in ranks:
        saved = out["checkpoints"]["disk"]
        for whole, resumed in (("whole", "resumed"), ("flat_whole", "flat_resumed")):
            assert saved[resumed][0] == saved[whole][0]
            for got, want in zip(saved[resumed][1], saved[whole][1], strict=True):
                assert torch.equal(got, want)
        # Flat in-memory zero3 steps with torch's foreach AdamW where the host ran its fused one: ulps apart.
        torch.testing.assert_close(torch.tensor(saved["flat"][0]), torch.tensor(saved["whole"][0]), **TOL)
        for got, want in zip(saved["flat"][1], saved["whole"][1], strict=True):
            torch.testing.assert_close(got, want, **TOL)


def test_checkpoint_saved_under_one_topology_resumes_under_the_other(ranks) -> None:
    for rank, out in enumerate(ranks):
        for saved_hybrid, case in ((k, v) for k, v in out["checkpoints"].items() if k != "same"):
            losses, params = case["whole"]
            resumed_losses, resumed_params = case["resumed"]
            assert len(resumed_params) == len(params) == 5
            torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(losses), **TOL)
            for got, want in zip(resumed_params, params):
                torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} hybrid={saved_hybrid}: {m}")


def test_each_row_is_written_once(ranks, tmp_path: Path) -> None:
    """Under hybrid sharding the 2 ranks of replica 0 write every row of the file between them, the other replica
    nothing; flat, the 4 ranks do. The bytes of rows written add up to the sharded tensors' bytes exactly, and every
    range checks against the file's CRC-32 table (``consolidate`` checks them all)."""
    for saved_hybrid in (True, False):
        assert consolidate(ranks[0]["checkpoints"][saved_hybrid]["path"], tmp_path / f"{saved_hybrid}.safetensors")
        path = ranks[0]["checkpoints"][saved_hybrid]["path"]
        checkpoint = torch.load(path, mmap=True, weights_only=True)
        info = checkpoint["lightning_zero"]
        tensors = [sharded_module.tensor_at(checkpoint, location) for location in info["tensors"]]
        rows = sum(t.numel() * t.element_size() for t in tensors)
        table = info["crc32"].numel() * info["crc32"].element_size()
        written = [out["checkpoints"][saved_hybrid]["written"] for out in ranks]
        assert sum(written) == rows + table
        writers = K if saved_hybrid else WORLD
        assert info["world_size"] == writers
        assert all(w > 0 for w in written[:writers]) and all(w == 0 for w in written[writers:])


@pytest.mark.parametrize(("name", "stage"), [("accumulate", 1), ("accumulate", 2), ("unused", 2), ("unused", 3)])
def test_hybrid_matches_flat_with_accumulation_and_a_parameter_used_on_one_rank(ranks, name: str, stage: int) -> None:
    """A parameter only rank 3 uses is stepped everywhere, as DDP steps it (flat stage 3 once kept only the rows of
    the ranks that used it: replicas then diverged)."""
    for rank, out in enumerate(ranks):
        flat, hybrid = out["variants"][(name, stage, False)], out["variants"][(name, stage, True)]
        assert hybrid["replicas"] > 0
        torch.testing.assert_close(torch.tensor(hybrid["losses"]), torch.tensor(flat["losses"]), **TOL)
        for step, (got, want) in enumerate(zip(hybrid["params"], flat["params"])):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} step {step}: {m}")
        if name == "unused":
            ddp = out["variants"]["unused", "ddp"]
            for step, (got, want) in enumerate(zip(flat["params"], ddp["params"])):
                torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} step {step} vs DDP: {m}")


@pytest.mark.parametrize("stage", [2, 3])
def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_replica(ranks, stage: int) -> None:
    for out in ranks:
        flat, hybrid = out["nonfinite"][(stage, False)], out["nonfinite"][(stage, True)]
        assert hybrid["skipped"] == flat["skipped"] == 1
        assert hybrid["replicas"] > 0  # every rank holds the same parameters
        assert torch.equal(hybrid["params"][BAD_STEP], hybrid["params"][BAD_STEP - 1])  # the bad step changed nothing
        for got, want in zip(hybrid["params"], flat["params"]):
            torch.testing.assert_close(got, want, **TOL)


def test_a_topology_that_does_not_divide_the_world_fails_at_setup(ranks) -> None:
    for out in ranks:
        group, node = out["errors"]
        assert group == "shard_group_size=3 is invalid for a world of 4 ranks: it must divide the world size " \
                        "(allowed: 1, 2, 4)"
        assert node.startswith("node_size=3 is invalid for a world of 4 ranks")


def test_a_shard_group_size_below_one_is_refused_up_front() -> None:
    with pytest.raises(ZeroConfigError, match=r"^shard_group_size=0 is invalid"):
        ZeroStrategy(2, shard_group_size=0)


@pytest.mark.parametrize(("option", "stage"), OFFLOADED)
def test_hybrid_sharding_with_offload_matches_flat_offload_every_step(ranks, option: str, stage: int) -> None:
    """The host (or disk) steps a replica's shard of a group of 2 as it steps a shard of 4: the same losses, weights
    and clipped norm as flat sharding with the same offload; a rank holds what flat sharding over 2 ranks holds."""
    for rank, out in enumerate(ranks):
        flat, hybrid = out["offload"][(option, "flat")], out["offload"][(option, "2x2")]
        torch.testing.assert_close(torch.tensor(hybrid["losses"]), torch.tensor(flat["losses"]), **TOL)
        for step, (got, want) in enumerate(zip(hybrid["params"], flat["params"])):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} step {step}: {m}")
        assert not torch.equal(hybrid["params"][0], hybrid["params"][-1])
        torch.testing.assert_close(torch.tensor(hybrid["norms"]), torch.tensor(flat["norms"]), **TOL)
        assert hybrid["validate"] == pytest.approx(flat["validate"], rel=1e-6)
        # Only the replica all-reduce of the gradient shard crosses, as without offload.
        assert hybrid["cross"] == out["fits"][(stage, "2x2")]["cross"]


# ------------------------------------------------------------------------------------------------- six ranks


def _six(rank: int, world_size: int) -> dict:
    out = {}
    for stage in (2, 3):
        for group in (None, 2, 3):  # flat, 3 nodes x 2, 2 nodes x 3
            units = {"units": ("Block",)} if stage == 3 else {}
            topology = {"shard_group_size": group} if group else {}
            pl.seed_everything(1234, verbose=False)
            model, log, recorder = TinyLM(), StepLog(), Recorder()
            trainer = make_trainer(ZeroStrategy(stage, **topology, **units), world_size, max_steps=4,
                                   callbacks=[log, recorder], gradient_clip_val=CLIP)
            trainer.fit(model)
            out[(stage, group)] = {"losses": recorder.losses, "params": recorder.params, "norms": log.norms,
                                   "cross": log.cross, "shapes": [p.shape for p in model.parameters()]}
    return out


@pytest.fixture(scope="module")
def six_ranks() -> list[dict]:
    return run_on_ranks(_six, 6)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("group", [2, 3], ids=["3x2", "2x3"])
def test_six_ranks_in_three_groups_of_two_and_two_groups_of_three(six_ranks, stage: int, group: int) -> None:
    """Parity with flat sharding over the 6, and the cross-node bytes of the replica all-reduce, a ring over the
    ``6 / group`` replicas, each on its own node: ``2 (R-1)/R`` of the gradient shard."""
    replicas = 6 // group
    shapes = six_ranks[0][(stage, None)]["shapes"]
    expected = 2 * (replicas - 1) / replicas * 4 * _segment(shapes, group)
    for rank, out in enumerate(six_ranks):
        flat, hybrid = out[(stage, None)], out[(stage, group)]
        torch.testing.assert_close(torch.tensor(hybrid["losses"]), torch.tensor(flat["losses"]), **TOL)
        for got, want in zip(hybrid["params"], flat["params"]):
            torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(torch.tensor(hybrid["norms"]), torch.tensor(flat["norms"]), **TOL)
        for cross in hybrid["cross"][1:]:  # each call counts whole bytes: at 3 replicas a third is rounded per bucket
            assert cross == pytest.approx(expected, abs=4), rank
