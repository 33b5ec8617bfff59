"""Sharded checkpoints: exact resume, resume at another world size and stage, consolidation, Lightning's
ModelCheckpoint (top-k, last as a copy or a link), atomic saves, and clear errors for the wrong model or damaged
files."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import safetensors.torch
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import CheckpointError, consolidate
from lightning_zero.cli import main
from tests.checkpoint_bytes import rows_range
from tests.harness import run_on_ranks
from tests.models import ParityModel, Recorder, StepSeededLM, TinyLM, flat_params, make_trainer


def zero(stage: int) -> ZeroStrategy:
    return ZeroStrategy(stage, units=("Block",)) if stage == 3 else ZeroStrategy(stage)


def _fit(strategy, world_size, steps, ckpt_path=None, precision="32-true", model=None):
    pl.seed_everything(5, verbose=False)
    model = model or StepSeededLM()
    recorder = Recorder()
    trainer = make_trainer(strategy, world_size, max_steps=steps, callbacks=[recorder], precision=precision)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, recorder


# ------------------------------------------------------------------------------------------------ exact resume


def _resume(rank: int, world_size: int, root: Path) -> dict:
    out = {}
    for stage in (1, 2, 3):
        for precision in ("32-true", "bf16-mixed"):
            _, whole = _fit(zero(stage), world_size, 10, precision=precision)
            first, _ = _fit(zero(stage), world_size, 5, precision=precision)
            path = root / f"z{stage}-{precision}.ckpt"
            first.save_checkpoint(path)
            _, resumed = _fit(zero(stage), world_size, 10, ckpt_path=path, precision=precision)
            out[(stage, precision)] = (whole.losses[5:], whole.params[5:], resumed.losses, resumed.params)
    return out


def test_save_at_5_and_resume_to_10_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    for per_rank in run_on_ranks(lambda r, w: _resume(r, w, tmp_path), 2):
        for (stage, precision), (losses, params, resumed_losses, resumed_params) in per_rank.items():
            assert len(resumed_params) == len(params) == 5
            # Bitwise, in fp32 and in bf16-mixed alike: fp32 masters, moments, step counters, the LR scheduler and
            # the loss scale all come back exactly.
            assert resumed_losses == losses, (stage, precision)
            for got, want in zip(resumed_params, params):
                assert torch.equal(got, want), (stage, precision)


# ----------------------------------------------------------------------------------------- another world size


def _save(rank, world_size, stage, path):
    trainer, recorder = _fit(zero(stage), world_size, 4)
    trainer.save_checkpoint(path)
    return recorder.params[-1]


def _load_and_save_again(rank, world_size, stage, path, again):
    """Load at another world size and stage, save again at once (no step in between), then train on."""
    trainer, _ = _fit(zero(stage), world_size, 4, ckpt_path=path)
    trainer.save_checkpoint(again)
    _, recorder = _fit(zero(stage), world_size, 6, ckpt_path=again)
    return recorder.losses


@pytest.mark.parametrize(
    "source,target", [((2, 3), (1, 1)), ((2, 3), (4, 2)), ((4, 2), (2, 3))], ids=["2xz3-1xz1", "2xz3-4xz2", "4xz2-2xz3"]
)
def test_resume_at_another_world_size_and_stage(tmp_path: Path, source, target) -> None:
    (n, s), (m, t) = source, target
    saved, again = tmp_path / "saved.ckpt", tmp_path / "again.ckpt"
    run_on_ranks(lambda r, w: _save(r, w, s, saved), n)
    losses = run_on_ranks(lambda r, w: _load_and_save_again(r, w, t, saved, again), m)
    consolidate(saved, tmp_path / "saved.pt", training_state=True)
    consolidate(again, tmp_path / "again.pt", training_state=True)
    before = torch.load(tmp_path / "saved.pt", weights_only=False)
    after = torch.load(tmp_path / "again.pt", weights_only=False)
    for key, value in before["state_dict"].items():
        assert torch.equal(after["state_dict"][key], value), key
    want, got = before["optimizer_states"][0], after["optimizer_states"][0]
    assert got["param_groups"] == want["param_groups"]
    assert len(want["state"]) == 26
    for index, state in want["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got["state"][index][key], state[key]), (index, key)
    assert after["global_step"] == before["global_step"] == 4
    assert all(len(per_rank) == 2 and all(map(torch.isfinite, map(torch.tensor, per_rank))) for per_rank in losses)


# ------------------------------------------------------------------------------------------------ consolidation


def _train_and_predict(rank, world_size, path):
    trainer, _ = _fit(zero(3), world_size, 4)
    trainer.save_checkpoint(path)
    model = trainer.lightning_module  # after fit: full weights again
    tokens = torch.arange(10).remainder(11).view(2, 5)
    return model(tokens)


def test_consolidated_weights_load_into_the_bare_model(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    logits = run_on_ranks(lambda r, w: _train_and_predict(r, w, path), 2)[0]
    tokens = torch.arange(10).remainder(11).view(2, 5)
    keys = consolidate(path, tmp_path / "weights.safetensors")
    assert "lm.head.weight" in keys and "lm.wte.weight" in keys  # the tied weight under both of its names
    for loaded in (
        safetensors.torch.load_file(tmp_path / "weights.safetensors"),
        torch.load(_consolidated(path, tmp_path / "weights.ckpt"), weights_only=True)["state_dict"],
    ):
        bare = TinyLM()
        bare.configure_model()
        bare.load_state_dict(loaded)
        assert torch.equal(bare(tokens), logits)
    bf16 = tmp_path / "bf16.safetensors"
    consolidate(path, bf16, dtype=torch.bfloat16)
    assert safetensors.torch.load_file(bf16)["lm.wte.weight"].dtype == torch.bfloat16


def _consolidated(path: Path, out: Path) -> Path:
    consolidate(path, out)
    return out


# ------------------------------------------------------------------------------------------- lightning's paths


def _with_model_checkpoint(rank, world_size, root, save_last):
    pl.seed_everything(5, verbose=False)
    callback = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max",
                               save_last=save_last)
    trainer = make_trainer(zero(2), world_size, max_steps=6, callbacks=[callback], enable_checkpointing=True)
    trainer.fit(StepSeededLM())
    names = sorted(os.listdir(root))
    _, recorder = _fit(zero(3), world_size, 8, ckpt_path=root / "last.ckpt")
    return names, recorder.losses, callback.best_model_path


@pytest.mark.parametrize("save_last", [True, "link"])
def test_model_checkpoint_top_k_last_and_resume_from_last(tmp_path: Path, save_last) -> None:
    names, losses, best = run_on_ranks(lambda r, w: _with_model_checkpoint(r, w, tmp_path, save_last), 2)[0]
    # top 2 kept, step 2 deleted; each a regular file and nothing else in the directory (as under DDP)
    assert names == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert all((tmp_path / n).is_file() for n in names)
    last = tmp_path / "last.ckpt"
    assert last.is_symlink() == (save_last == "link")
    assert Path(best) == tmp_path / "epoch=0-step=6.ckpt"
    for key, value in torch.load(best)["state_dict"].items():
        assert torch.equal(torch.load(last)["state_dict"][key], value), key
    assert len(losses) == 2


# ------------------------------------------------------------------------------------------------------- safety


def _save_twice_dying(rank, world_size, path):
    trainer, recorder = _fit(zero(2), world_size, 2)
    trainer.save_checkpoint(path)
    if rank == 1:
        import lightning_zero.checkpoint.sharded as sharded

        def die(*args, **kwargs):
            os._exit(17)

        sharded.write_rows = die  # rank 1 dies while writing its rows
    trainer.save_checkpoint(path)
    return recorder.params[-1]


def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    with pytest.raises(AssertionError, match="died|rank 0"):
        run_on_ranks(lambda r, w: _save_twice_dying(r, w, path), 2, timeout_s=60)
    keys = consolidate(path, tmp_path / "w.pt")  # the first save, intact
    assert len(keys) > 0
    model = TinyLM()
    model.configure_model()
    model.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True)["state_dict"])


def _load_wrong(rank, world_size, path, model_cls):
    model = model_cls()
    trainer = make_trainer(zero(2), world_size, max_steps=1)
    try:
        trainer.fit(model, ckpt_path=path)
    except CheckpointError as err:
        return str(err), flat_params(model)
    raise AssertionError("loading did not fail")


def test_wrong_model_or_damaged_files_fail_clearly_before_changing_anything(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    run_on_ranks(lambda r, w: _save(r, w, 2, path), 2)

    class Wider(TinyLM):
        def __init__(self):
            super().__init__(d_model=32)

    pl.seed_everything(0)
    message, params = run_on_ranks(lambda r, w: _load_wrong(r, w, path, Wider), 2)[0]
    assert "shapes differ" in message and "lm.wte.weight: checkpoint (11, 16), model (11, 32)" in message
    pl.seed_everything(0)
    fresh = Wider()
    fresh.configure_model()
    assert torch.equal(params, flat_params(fresh))  # untouched
    message, _ = run_on_ranks(lambda r, w: _load_wrong(r, w, path, ParityModel), 2)[0]
    assert "missing from the checkpoint: ['block.ln1.bias'" in message and "not in the model: ['lm.blocks.0" in message

    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    message, _ = run_on_ranks(lambda r, w: _load_wrong(r, w, path, TinyLM), 2)[0]
    assert f"checkpoint file {path} is corrupt: it is not a complete torch.save archive" in message


def _load_corrupt(rank, world_size, path):
    """Train 2 steps, then load a checkpoint whose shard file is corrupt: the error must leave the live shards and the
    optimizer state exactly as they were."""
    trainer, _ = _fit(zero(2), world_size, 2)
    before_params = flat_params(trainer.lightning_module)
    before_state = {k: v.clone() for k, v in trainer.optimizers[0].state_dict()["state"][0].items()}
    try:
        checkpoint = trainer.strategy.load_checkpoint(path)  # then restore from it, as Lightning does
        trainer.strategy.load_model_state_dict(checkpoint)
        trainer.strategy.load_optimizer_state_dict(checkpoint)
    except CheckpointError as err:
        message = str(err)
    else:
        raise AssertionError("loading did not fail")
    trainer.strategy.teardown()  # gathers the full parameters from the shards
    after_state = trainer.optimizers[0].state_dict()["state"][0]
    return message, torch.equal(flat_params(trainer.lightning_module), before_params), all(
        torch.equal(after_state[k].cpu(), v.cpu()) for k, v in before_state.items()
    )


def test_a_corrupt_full_length_shard_fails_on_every_rank_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    run_on_ranks(lambda r, w: _save(r, w, 2, path), 2)
    _zero_rows_of(path, ("state_dict", "lm.wte.weight"), rank=1)  # same length, a valid archive: only checksums see it
    for message, params_unchanged, state_unchanged in run_on_ranks(lambda r, w: _load_corrupt(r, w, path), 2):
        assert f"reading {path} failed on rank(s) [1] (checkpoint file {path} is corrupt: bytes 384-704 of " \
            "state_dict['lm.wte.weight'] (rows 6-11, written by rank 1) differ from the CRC-32 recorded when they " \
            "were saved); nothing was changed" in message, message
        assert params_unchanged and state_unchanged


def _zero_rows_of(path: Path, location: tuple, rank: int) -> None:
    """Overwrite with zeros the bytes that ``rank`` (of 2) wrote of the tensor at ``location``."""
    offset, length = rows_range(path, location, rank, 2)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(length))


def test_consolidate_command(tmp_path: Path, capsys) -> None:
    path = tmp_path / "run.ckpt"
    run_on_ranks(lambda r, w: _save(r, w, 3, path), 2)
    assert main(["consolidate", str(path), str(tmp_path / "w.safetensors"), "--dtype", "bf16"]) == 0
    assert "wrote 27 tensors" in capsys.readouterr().out  # 26 parameters + the tied head under its own name
    assert safetensors.torch.load_file(tmp_path / "w.safetensors")["lm.head.weight"].dtype == torch.bfloat16
    assert main(["consolidate", str(tmp_path / "nothing"), str(tmp_path / "x.pt")]) == 2
    assert f"{tmp_path / 'nothing'} is not a checkpoint: there is no such file" in capsys.readouterr().err
    assert main(["consolidate", str(path), str(tmp_path / "x.safetensors"), "--training-state"]) == 2
