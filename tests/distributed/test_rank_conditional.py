"""Code that reads gradients or parameters on one rank only, as DDP code does (issue 52; see [Note: a read that runs
on one rank] in sharding/joined_reads.py): what DDP code commonly computes on one rank gives DDP's value there with
no collective, and what cannot be answered alone fails on that rank at once, naming the call and the way out, while
the other ranks end with an error naming that rank: never a hang. ``torch.save(module.state_dict())`` on one rank
under zero3 is refused where it runs (the values are the rank's rows), with no collective.

Values: one fork of 2 ranks runs DDP and zero1/2/3 with rank-0-only readers (a hook under ``is_global_zero``, a
``@rank_zero_only`` callback, Lightning's ``grad_norm``) and compares what rank 0 read with DDP's, every step.
Failures: one fork per case, each timed from the read to the end of every rank.
"""

from __future__ import annotations

import time
from functools import lru_cache, partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import grad_norm, rank_zero_only

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import ParityModel, make_trainer
from tests.reliability.ranks import launch

STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


class RankZeroReads(pl.Callback):
    """What DDP code reads on rank 0 only, every step: each gradient's norm, the sum of their squares, the largest
    magnitude of one, Lightning's ``grad_norm``, the norm ``clip_grad_norm_`` returns (with a bound that never
    clips), and the same after the step (``on_train_batch_end``: the clipped gradients)."""

    def __init__(self) -> None:
        self.before: list[list[float]] = []
        self.after: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not trainer.is_global_zero:
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        total = sum(g.norm() ** 2 for g in grads)
        norms = grad_norm(pl_module, 2)
        self.before.append([float(total), float(pl_module.head.weight.grad.abs().max().item()),
                            float(pl_module.embed.weight.grad.norm(float("inf"))), norms["grad_2.0_norm_total"],
                            float(torch.nn.utils.clip_grad_norm_(pl_module.parameters(), 1e6))])
        self._log_magnitudes(pl_module)

    @rank_zero_only
    def _log_magnitudes(self, pl_module) -> None:  # what gradient loggers do
        self.before[-1].append(max(float(p.grad.abs().max()) for p in pl_module.parameters() if p.grad is not None))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            self.after.append(float(pl_module.head.weight.grad.norm()))


def _values(strategy) -> dict:
    pl.seed_everything(7, verbose=False)
    reads = RankZeroReads()
    trainer = make_trainer(strategy, 2, max_steps=4, callbacks=[reads], gradient_clip_val=0.05)
    trainer.fit(ParityModel())
    return {"before": reads.before, "after": reads.after}


def _value_cases(rank: int, world_size: int) -> dict:
    out = {"ddp": _values(DDPStrategy())}
    for name, stage in STAGES.items():
        out[name] = _values(ZeroStrategy(stage=stage))
    return out


@lru_cache(maxsize=None)
def _rank0_values() -> dict:
    return run_on_ranks(_value_cases, 2)[0]


@pytest.mark.parametrize("name", list(STAGES))
def test_norms_read_on_rank_zero_alone_are_ddps(name: str) -> None:
    got, want = _rank0_values()[name], _rank0_values()["ddp"]
    assert len(got["before"]) == len(want["before"]) == 4
    torch.testing.assert_close(torch.tensor(got["before"]), torch.tensor(want["before"]), rtol=1e-5, atol=1e-7)
    # after the step: the gradients Trainer(gradient_clip_val) clipped, as DDP's are
    torch.testing.assert_close(torch.tensor(got["after"]), torch.tensor(want["after"]), rtol=1e-5, atol=1e-7)
    assert want["after"][0] < want["before"][0][0] ** 0.5  # the clip did act: the comparison sees it


# ----------------------------------------------------------------------------------------------------- failures


class RankZeroOnly(pl.Callback):
    """Runs ``read`` on rank 0 only in ``on_before_optimizer_step`` of the second step; records when."""

    def __init__(self, read, root: Path) -> None:
        self.read, self.root = read, root

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.is_global_zero and trainer.global_step == 1:
            (self.root / "read_at").write_text(repr(time.monotonic()))
            self.read(trainer, pl_module)


def _grad_sum(trainer, module) -> None:
    float(module.head.weight.grad.sum())


def _values_norm(trainer, module) -> None:
    float(module.head.weight.data.norm())


def _gathered_gradients(trainer, module) -> None:
    with trainer.strategy.gathered_gradients():
        pass


def _gathered_parameters(trainer, module) -> None:
    with trainer.strategy.gathered_parameters():
        pass


def _save_state_dict(trainer, module) -> None:
    torch.save(module.state_dict(), Path(trainer.default_root_dir) / "weights.pt")


JOINED = "rank 1 went on without it"
#: name -> (stage, the read, its error: the class, what it names)
FAILURES = {
    "grad_sum": (2, _grad_sum, "OneRankReadError", "sum() on the gradient of 'head.weight'", JOINED,
                 "gathered_gradients()"),
    "values_norm": (3, _values_norm, "OneRankReadError", "norm() on the values of zero3 parameter 'head.weight'",
                    JOINED, "gathered_parameters()"),
    "gathered_gradients": (1, _gathered_gradients, "OneRankReadError", "trainer.strategy.gathered_gradients()",
                           JOINED, "gathered_gradients()"),
    "gathered_parameters": (3, _gathered_parameters, "OneRankReadError", "trainer.strategy.gathered_parameters()",
                            JOINED, "gathered_parameters()"),
    # refused where it runs, with no collective: the values are this rank's rows
    "save_state_dict": (3, _save_state_dict, "ShardedParameterError", "pickling (torch.save) on the values of zero3 "
                        "parameter", "each rank holds only its rows", "gathered_parameters()"),
}


def _fail(rank: int, world_size: int, stage: int, read, root: Path) -> None:
    pl.seed_everything(7, verbose=False)
    trainer = make_trainer(ZeroStrategy(stage=stage), 2, max_steps=4, callbacks=[RankZeroOnly(read, root)],
                           default_root_dir=root)
    trainer.fit(ParityModel())


@lru_cache(maxsize=None)
def _failed(name: str, root: str) -> tuple:
    stage, read = FAILURES[name][:2]
    outcomes = launch(partial(_fail, stage=stage, read=read, root=Path(root)), 2, timeout_s=60)
    return outcomes, float((Path(root) / "read_at").read_text())


@pytest.mark.parametrize("name", list(FAILURES))
def test_a_read_on_one_rank_ends_every_rank_at_once_naming_it(name: str, tmp_path: Path) -> None:
    outcomes, read_at = _failed(name, str(tmp_path))
    _, _, error, call, why, way_out = FAILURES[name]
    reader, peer = outcomes
    assert reader.error is not None and f"{error}: " in reader.error, reader.error or reader.stderr[-2000:]
    message = reader.error.strip().splitlines()[-1]
    assert call in message and why in message, message
    assert way_out in message and "every rank" in message, message
    # The peer ends too, naming rank 0, within seconds: no wait for the process group's timeout. It names rank 0's
    # error where it can still read it; here rank 0's process, which hosts the store, exits as soon as it raised
    # (this harness's os._exit), so the peer may find it gone first.
    assert not peer.hung and peer.exitcode != 0
    told = (peer.error or "") + peer.stderr
    assert f"rank 0 failed: {error}" in told or "rank 0 is gone" in told, (peer.error, peer.stderr[-2000:])
    assert max(reader.ended, peer.ended) - read_at < 10.0
