"""Damaged checkpoints and checkpoints that do not fit: one clear error naming the file and what in it is damaged,
or the keys, on every rank, with the live shards, buffers and optimizer state bitwise unchanged; and what is fine
(another precision, a DDP checkpoint).

One fork saves the checkpoints (the model, a wider model, an SGD run, a bf16-mixed run, a DDP run); this process
damages copies of the first; one more fork trains a differently seeded model, then tries to load each into it.
Checkpoint directories of the earlier format: tests/reliability/test_legacy_checkpoints.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import CheckpointError, consolidate
from tests.checkpoint_bytes import data_records, flip_byte, record_range, rows_range
from tests.harness import run_on_ranks
from tests.models import TinyLM, make_trainer

WTE = ("state_dict", "lm.wte.weight")
EXP_AVG = ("optimizer_states", 0, "state", 0, "exp_avg")  # lm.wte.weight's first moment


class Wider(TinyLM):
    def __init__(self) -> None:
        super().__init__(d_model=32)


class WithSGD(TinyLM):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _flip_rows(path: Path, location: tuple, rank: int) -> None:
    offset, length = rows_range(path, location, rank, 2)
    flip_byte(path, offset + length // 2)


def _flip_record(path: Path, name: str) -> None:
    offset, length = record_range(path, name)
    flip_byte(path, offset + length // 2)


def _cut(path: Path, keep: float) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


def _last_record(path: Path) -> str:
    """The last storage torch.save's writer wrote itself (an optimizer step counter: after the ranks' records)."""
    return data_records(path)[-1]


#: name -> (damage done to a copy of the good checkpoint, what the error must say; "{path}" is the copy).
DAMAGED = {
    "truncated": (lambda p: _cut(p, 0.5), "checkpoint file {path} is corrupt: it is not a complete torch.save archive"),
    "truncated-tail": (lambda p: _cut(p, 0.999), "checkpoint file {path} is corrupt: it is not a complete torch.save"),
    "flipped-rows-rank-0": (
        lambda p: _flip_rows(p, WTE, 0),
        "reading {path} failed on rank(s) [0] (checkpoint file {path} is corrupt: bytes 0-384 of "
        "state_dict['lm.wte.weight'] (rows 0-6, written by rank 0) differ from the CRC-32 recorded when they were "
        "saved); nothing was changed",
    ),
    "flipped-optimizer-rows-rank-1": (
        lambda p: _flip_rows(p, EXP_AVG, 1),
        "reading {path} failed on rank(s) [1] (checkpoint file {path} is corrupt: bytes 384-704 of "
        "optimizer_states[0]['state'][0]['exp_avg'] (rows 6-11, written by rank 1) differ",
    ),
    "flipped-pickle": (
        lambda p: _flip_record(p, "data.pkl"), "checkpoint file {path} is corrupt: its record data.pkl is corrupt"
    ),
    "flipped-step-counter": (
        lambda p: _flip_record(p, _last_record(p)), "checkpoint file {path} is corrupt: its record data/"
    ),
    "flipped-crc-table": (
        lambda p: _flip_record(p, "data/0"), "checkpoint file {path} is corrupt: bytes "
    ),
    "deleted": (lambda p: p.unlink(), "Checkpoint file not found: {path}"),
    "not-a-checkpoint": (
        lambda p: p.write_text("not a checkpoint\n"), "checkpoint file {path} is corrupt: it is not a complete"
    ),
}
#: Checkpoints that do not fit this run (saved by the first fork).
FOREIGN = {
    "wider": "the checkpoint does not match this model; shapes differ: ['lm.blocks.0.ln1.bias: checkpoint (32,), "
    "model (16,)'",
    "sgd": "optimizer 0: the checkpoint holds the state of SGD, configure_optimizers returned AdamW",
}


def _fit(model, steps: int, seed: int, precision: str = "32-true", strategy=None):
    pl.seed_everything(seed, verbose=False)
    strategy = strategy or ZeroStrategy(3, units=("Block",))
    trainer = make_trainer(strategy, 2, max_steps=steps, precision=precision)
    trainer.fit(model)
    return trainer


def _save_all(rank: int, world_size: int, root: Path) -> None:
    _fit(TinyLM(), 3, seed=5).save_checkpoint(root / "good")
    _fit(Wider(), 1, seed=5).save_checkpoint(root / "wider")
    _fit(WithSGD(), 2, seed=5).save_checkpoint(root / "sgd")
    _fit(TinyLM(), 3, seed=7, strategy=DDPStrategy()).save_checkpoint(root / "ddp")
    _fit(TinyLM(), 3, seed=6, precision="bf16-mixed").save_checkpoint(root / "bf16")


def _live_state(trainer) -> list[torch.Tensor]:
    """Every live tensor a load may write: shards, buffers, optimizer state (cloned)."""
    runtime = trainer.strategy.runtime
    tensors = [s.local.detach().clone() for s in runtime.shards]
    tensors += [b.detach().clone() for b in trainer.lightning_module.buffers()]
    for entry in trainer.optimizers[0].state_dict()["state"].values():
        tensors += [v.detach().clone() for v in entry.values()]
    return tensors


def _restore(strategy, path: Path) -> None:
    """What Lightning does with a checkpoint path when fitting resumes: load it, then restore the model and the
    optimizer state from it."""
    checkpoint = strategy.load_checkpoint(path)
    strategy.load_model_state_dict(checkpoint)
    strategy.load_optimizer_state_dict(checkpoint)


def _try_loads(rank: int, world_size: int, root: Path, names: list[str]) -> dict:
    trainer = _fit(TinyLM(), 2, seed=11)
    before = _live_state(trainer)
    out = {}
    for name in names:
        try:
            _restore(trainer.strategy, root / name)
        except (CheckpointError, FileNotFoundError) as err:
            after = _live_state(trainer)
            unchanged = len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
            out[name] = (str(err), unchanged)
        else:
            after = _live_state(trainer)
            out[name] = (None, not all(torch.equal(a, b) for a, b in zip(after, before)))  # (no error, changed)
            before = after
    shards = {s.name: (s.spec, s.local.detach().clone()) for s in trainer.strategy.runtime.shards}
    return {"results": out, "shards": shards}


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    run_on_ranks(lambda r, w: _save_all(r, w, root), 2)
    for name, (damage, _) in DAMAGED.items():
        shutil.copy(root / "good", root / name)
        damage(root / name)
    # Damaged and foreign ones first (nothing may change), then the ones that must load: the last one loaded is
    # the bf16-mixed checkpoint, compared below with its consolidated weights.
    names = [*DAMAGED, *FOREIGN, "good", "ddp", "bf16"]
    return root, run_on_ranks(lambda r, w: _try_loads(r, w, root, names), 2)


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_damaged_checkpoint_fails_on_every_rank_naming_the_file_and_changes_nothing(loads, name: str) -> None:
    root, per_rank = loads
    expected = DAMAGED[name][1].format(path=root / name)
    for rank, result in enumerate(per_rank):
        message, unchanged = result["results"][name]
        assert message is not None, f"rank {rank} loaded the {name} checkpoint"
        assert expected in message, message
        assert unchanged, f"rank {rank}: the failed load of {name} changed live state"
    assert per_rank[0]["results"][name][0] == per_rank[1]["results"][name][0]  # one error, the same on every rank


@pytest.mark.parametrize("name", list(FOREIGN))
def test_a_checkpoint_that_does_not_fit_fails_on_every_rank_naming_the_keys_and_changes_nothing(loads, name) -> None:
    _, per_rank = loads
    for rank, result in enumerate(per_rank):
        message, unchanged = result["results"][name]
        assert message is not None and FOREIGN[name] in message, message
        assert unchanged, f"rank {rank}: the failed load of {name} changed live state"


def test_intact_ddp_and_other_precision_checkpoints_load(loads) -> None:
    """The good checkpoint, a DDP checkpoint, and a bf16-mixed checkpoint into an fp32 run (its fp32 masters become
    this run's parameters, bitwise)."""
    root, per_rank = loads
    weights = root / "bf16.pt"
    consolidate(root / "bf16", weights)
    full = torch.load(weights, weights_only=True)["state_dict"]
    for result in per_rank:
        # Each of them changes the live state (which shows that the comparisons above can see a change).
        for name in ("good", "ddp", "bf16"):
            assert result["results"][name] == (None, True), (name, result["results"][name])
        for name, (spec, local) in result["shards"].items():
            assert torch.equal(local.reshape(-1), spec.local_view(full[name]).reshape(-1)), name


def test_consolidate_checks_every_byte(loads) -> None:
    root, _ = loads
    with pytest.raises(CheckpointError, match=r"is corrupt: bytes 0-384 of state_dict\['lm.wte.weight'\]"):
        consolidate(root / "flipped-rows-rank-0", root / "out.safetensors")
    with pytest.raises(CheckpointError, match=r"bytes 384-704 of optimizer_states\[0\]\['state'\]\[0\]\['exp_avg'\]"):
        consolidate(root / "flipped-optimizer-rows-rank-1", root / "out.pt", training_state=True)
    with pytest.raises(CheckpointError, match="its record data.pkl is corrupt"):
        consolidate(root / "flipped-pickle", root / "out.pt")
    assert len(consolidate(root / "good", root / "out.safetensors")) == 27
