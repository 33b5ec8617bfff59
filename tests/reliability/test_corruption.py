"""Damaged checkpoints and checkpoints that do not fit: one clear error naming the file or the keys, on every rank,
with the live shards, buffers and optimizer state bitwise unchanged; and what is fine (another precision, a
checkpoint saved before checksums were recorded).

One fork saves the checkpoints (the model, a wider model, an SGD run, a bf16-mixed run); this process damages copies
of the first; one more fork trains a differently seeded model, then tries to load each into it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import CheckpointError, consolidate
from lightning_zero.checkpoint.layout import MANIFEST_FILE, check_files
from tests.harness import run_on_ranks
from tests.models import TinyLM, make_trainer


class Wider(TinyLM):
    def __init__(self) -> None:
        super().__init__(d_model=32)


class WithSGD(TinyLM):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _flip(file: Path, at: float = 0.5) -> None:
    data = bytearray(file.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    file.write_bytes(bytes(data))


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _alter_a_recorded_checksum(file: Path) -> None:
    manifest = json.loads(file.read_text())
    manifest["files"]["__0_0.distcp"]["crc32"] ^= 1
    file.write_text(json.dumps(manifest))


def _without_manifest(path: Path) -> None:
    (path / MANIFEST_FILE).unlink()


#: name -> (damage done to a copy of the good checkpoint, what the error must say; "{path}" is the copy).
DAMAGED = {
    "truncated-shard": (
        lambda p: _truncate(p / "__1_0.distcp"), "checkpoint shard file {path}/__1_0.distcp is truncated"
    ),
    "flipped-shard": (
        lambda p: _flip(p / "__0_0.distcp"),
        (
            "reading {path} failed on rank(s) [0{ranks}] (checkpoint file {path}/__0_0.distcp is corrupt: its CRC-32 "
            "differs from the one recorded when it was saved); nothing was changed"
        ),
    ),
    "flipped-shard-end": (lambda p: _flip(p / "__1_0.distcp", 0.999), "{path}/__1_0.distcp is corrupt"),
    "deleted-shard": (lambda p: (p / "__1_0.distcp").unlink(), "checkpoint shard file {path}/__1_0.distcp is missing"),
    "altered-metadata": (lambda p: _flip(p / ".metadata"), "checkpoint file {path}/.metadata is corrupt"),
    "altered-lightning-pt": (lambda p: _flip(p / "lightning.pt"), "checkpoint file {path}/lightning.pt is corrupt"),
    "altered-manifest": (
        lambda p: _alter_a_recorded_checksum(p / MANIFEST_FILE),
        "checkpoint manifest {path}/checksums.json is damaged: its content does not match its own checksum",
    ),
    "unreadable-manifest": (
        lambda p: (p / MANIFEST_FILE).write_text("{not json"), "checkpoint manifest {path}/checksums.json is damaged"
    ),
    "no-manifest-truncated-metadata": (
        lambda p: (_without_manifest(p), _truncate(p / ".metadata")), "{path}/.metadata cannot be read"
    ),
    "no-manifest-truncated-lightning-pt": (
        lambda p: (_without_manifest(p), _truncate(p / "lightning.pt")), "{path}/lightning.pt cannot be read"
    ),
}
#: Checkpoints that do not fit this run (saved by the first fork).
FOREIGN = {
    "wider": "the checkpoint does not match this model; shapes differ: ['lm.blocks.0.ln1.bias: checkpoint (32,), "
    "model (16,)'",
    "sgd": "optimizer 0: the checkpoint holds the state of SGD, configure_optimizers returned AdamW",
}


def _fit(model, steps: int, seed: int, precision: str = "32-true"):
    pl.seed_everything(seed, verbose=False)
    trainer = make_trainer(ZeroStrategy(3, units=("Block",)), 2, max_steps=steps, precision=precision)
    trainer.fit(model)
    return trainer


def _save_all(rank: int, world_size: int, root: Path) -> None:
    _fit(TinyLM(), 3, seed=5).save_checkpoint(root / "good")
    _fit(Wider(), 1, seed=5).save_checkpoint(root / "wider")
    _fit(WithSGD(), 2, seed=5).save_checkpoint(root / "sgd")
    _fit(TinyLM(), 3, seed=6, precision="bf16-mixed").save_checkpoint(root / "bf16")


def _live_state(trainer) -> list[torch.Tensor]:
    """Every live tensor a load may write: shards, buffers, optimizer state (cloned)."""
    runtime = trainer.strategy.runtime
    tensors = [s.local.detach().clone() for s in runtime.shards]
    tensors += [b.detach().clone() for b in trainer.lightning_module.buffers()]
    for entry in trainer.optimizers[0].state_dict()["state"].values():
        tensors += [v.detach().clone() for v in entry.values()]
    return tensors


def _try_loads(rank: int, world_size: int, root: Path, names: list[str]) -> dict:
    trainer = _fit(TinyLM(), 2, seed=11)
    before = _live_state(trainer)
    out = {}
    for name in names:
        try:
            trainer.strategy.load_checkpoint(root / name)
        except CheckpointError as err:
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
        shutil.copytree(root / "good", root / name)
        damage(root / name)
    shutil.copytree(root / "good", root / "legacy")
    _without_manifest(root / "legacy")
    # Damaged and foreign ones first (nothing may change), then the ones that must load: the last one loaded is
    # the bf16-mixed checkpoint, compared below with its consolidated weights.
    names = [*DAMAGED, *FOREIGN, "good", "legacy", "bf16"]
    return root, run_on_ranks(lambda r, w: _try_loads(r, w, root, names), 2)


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_damaged_checkpoint_fails_on_every_rank_naming_the_file_and_changes_nothing(loads, name: str) -> None:
    root, per_rank = loads
    expected = DAMAGED[name][1]
    for rank, result in enumerate(per_rank):
        message, unchanged = result["results"][name]
        assert message is not None, f"rank {rank} loaded the {name} checkpoint"
        if "{ranks}" in expected:  # which ranks read the damaged file depends on DCP's plan: rank 0, maybe rank 1
            assert any(expected.format(path=root / name, ranks=r) in message for r in ("", ", 1")), message
        else:
            assert expected.format(path=root / name) in message, message
        assert unchanged, f"rank {rank}: the failed load of {name} changed live state"


@pytest.mark.parametrize("name", list(FOREIGN))
def test_a_checkpoint_that_does_not_fit_fails_on_every_rank_naming_the_keys_and_changes_nothing(loads, name) -> None:
    _, per_rank = loads
    for rank, result in enumerate(per_rank):
        message, unchanged = result["results"][name]
        assert message is not None and FOREIGN[name] in message, message
        assert unchanged, f"rank {rank}: the failed load of {name} changed live state"


def test_intact_legacy_and_other_precision_checkpoints_load(loads) -> None:
    """The good checkpoint, the same without a manifest (saved before checksums: not verified), and a bf16-mixed
    checkpoint into an fp32 run (its fp32 masters become this run's parameters, bitwise)."""
    root, per_rank = loads
    weights = root / "bf16.pt"
    consolidate(root / "bf16", weights)
    full = torch.load(weights, weights_only=True)["state_dict"]
    for result in per_rank:
        # Each of them changes the live state (which shows that the comparisons above can see a change), except the
        # legacy copy, loaded right after the identical good one.
        for name, changed in (("good", True), ("legacy", False), ("bf16", True)):
            assert result["results"][name] == (None, changed), (name, result["results"][name])
        for name, (spec, local) in result["shards"].items():
            assert torch.equal(local.reshape(-1), spec.local_view(full[name]).reshape(-1)), name


def test_consolidate_checks_every_file(loads) -> None:
    root, _ = loads
    with pytest.raises(CheckpointError, match="__0_0.distcp is corrupt"):
        consolidate(root / "flipped-shard", root / "out.safetensors")
    with pytest.raises(CheckpointError, match="__1_0.distcp is corrupt"):
        check_files(root / "flipped-shard-end")
    check_files(root / "legacy")  # no manifest: nothing to verify against
