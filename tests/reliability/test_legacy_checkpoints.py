"""Checkpoint directories of the format lightning_zero wrote before checkpoints became one file still load (resume at
another world size and stage, each rank reading its rows) and consolidate; their checksums are still checked.

The fixture ``tests/data/legacy-zero3-2ranks.ckpt`` was written by lightning_zero at commit 3d1da29 (the last one
that wrote directories): ``TinyLM(d_model=8, n_layer=1)``, seed 5, zero3 with units ``Block`` on 2 ranks, 3 steps.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import safetensors.torch
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import CheckpointError, consolidate
from tests.harness import run_on_ranks
from tests.models import TinyLM, flat_params, make_trainer

FIXTURE = Path(__file__).parent.parent / "data" / "legacy-zero3-2ranks.ckpt"


def _small() -> TinyLM:
    return TinyLM(d_model=8, n_layer=1)


def _resume(rank: int, world_size: int, path: Path, stage: int) -> dict:
    """Resume from ``path`` for one more step; also the parameters as loaded (a fit of 3 steps, no step taken)."""
    pl.seed_everything(0, verbose=False)
    loaded = _small()
    trainer = make_trainer(ZeroStrategy(stage), world_size, max_steps=3)
    trainer.fit(loaded, ckpt_path=path)
    pl.seed_everything(0, verbose=False)
    resumed = _small()
    trainer = make_trainer(ZeroStrategy(stage), world_size, max_steps=4)
    trainer.fit(resumed, ckpt_path=path)
    return {"loaded": flat_params(loaded), "resumed": flat_params(resumed), "step": trainer.global_step}


def _weights(tmp_path: Path) -> torch.Tensor:
    consolidate(FIXTURE, tmp_path / "weights.pt")
    model = _small()
    model.configure_model()
    model.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True)["state_dict"])
    return flat_params(model)


@pytest.mark.parametrize("world_size,stage", [(2, 2), (1, 1)])
def test_a_checkpoint_directory_resumes_at_another_world_size_and_stage(tmp_path: Path, world_size, stage) -> None:
    want = _weights(tmp_path)
    for result in run_on_ranks(lambda r, w: _resume(r, w, FIXTURE, stage), world_size):
        assert torch.equal(result["loaded"], want)  # the saved parameters, bitwise
        assert result["step"] == 4 and not torch.equal(result["resumed"], want)  # and one step on from there


def test_a_checkpoint_directory_consolidates(tmp_path: Path) -> None:
    keys = consolidate(FIXTURE, tmp_path / "w.safetensors")
    assert "lm.head.weight" in keys and "lm.wte.weight" in keys
    weights = safetensors.torch.load_file(tmp_path / "w.safetensors")
    assert torch.equal(weights["lm.head.weight"], weights["lm.wte.weight"])  # the tied weight under both names
    full = consolidate(FIXTURE, tmp_path / "full.ckpt", training_state=True)
    state = torch.load(tmp_path / "full.ckpt", weights_only=False)
    assert sorted(full) == sorted(weights) and state["global_step"] == 3
    assert len(state["optimizer_states"][0]["state"]) == 15  # one per parameter, the tied one once


def test_a_damaged_checkpoint_directory_fails_naming_the_file(tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(FIXTURE, damaged)
    shard = damaged / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checkpoint file {shard} is corrupt"):
        consolidate(damaged, tmp_path / "w.safetensors")
    # Saved before checksums were recorded (no manifest): loads unchecked, as it was written.
    (damaged / "checksums.json").unlink()
    shard.write_bytes((FIXTURE / "__1_0.distcp").read_bytes())
    assert len(consolidate(damaged, tmp_path / "w.safetensors")) == 16  # 15 parameters, the tied one twice
