"""Every optimizer, sharded (issue 36): optimizers whose update is not element-wise (torch's Muon with AdamW for the
other parameters, torch's Adafactor, a user's Muon-with-auxiliary-AdamW class, a user's LARS) give DDP's losses at
every step under zero1/2/3 on a Hugging Face GPT-2 (2 ranks, fp32 and bf16-mixed), each parameter stepped whole by
the rank that owns it (sharding/ownership.py); they resume bit-exact from a checkpoint, and a zero3 checkpoint loads
at 1 rank under zero1. One fork for every case."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from lightning_zero.monitor import ZeroMonitor
from lightning_zero.sharding.flat_param import ShardSpec
from lightning_zero.sharding.ownership import owned_elements
from tests.distributed.test_lightning_semantics import _error
from tests.harness import run_on_ranks
from tests.models import make_trainer, pattern_loader
from tests.optimizers import LARS, MuonWithAuxAdam

transformers = pytest.importorskip("transformers")

OPTIMIZERS = ("muon", "adafactor", "muon_aux", "lars")
STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
STEPS = 8


class GPT2(pl.LightningModule):
    """A small GPT-2 from ``transformers``, built from a config, trained with ``optimizer``."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.model = transformers.GPT2LMHeadModel(config)
        self.optimizer_name = optimizer
        self.automatic_optimization = optimizer != "muon"  # two optimizers: Lightning's manual optimization

    def _loss(self, batch) -> torch.Tensor:
        tokens, _ = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        if not self.automatic_optimization:
            optimizers = self.optimizers()
            self.manual_backward(loss)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        return loss

    def _groups(self) -> tuple[list, list]:
        matrices = [p for n, p in self.named_parameters() if p.dim() == 2 and ".h." in n]
        rest = [p for n, p in self.named_parameters() if not (p.dim() == 2 and ".h." in n)]
        return matrices, rest

    def configure_optimizers(self):
        matrices, rest = self._groups()
        if self.optimizer_name == "muon":
            return [torch.optim.Muon(matrices, lr=2e-2, weight_decay=0.01), torch.optim.AdamW(rest, lr=1e-2)]
        if self.optimizer_name == "adafactor":
            return torch.optim.Adafactor(self.parameters(), lr=1e-2)
        if self.optimizer_name == "muon_aux":
            return MuonWithAuxAdam([{"params": matrices, "use_muon": True}, {"params": rest}])
        return LARS(self.parameters(), lr=0.5)

    def train_dataloader(self):
        return pattern_loader(64, 16, 32)  # 4 batches a rank: the resume below starts epoch 1


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def _steps(optimizer: str, batches: int) -> int:
    return batches * (2 if optimizer == "muon" else 1)  # max_steps counts each optimizer's steps


def _fit(strategy, optimizer: str, batches: int = STEPS, ckpt_path=None, callbacks=(), world_size: int = 2,
         **kwargs) -> tuple[pl.Trainer, list[float]]:
    pl.seed_everything(7, verbose=False)
    model = GPT2(optimizer)
    losses = Losses()
    trainer = make_trainer(strategy, world_size, max_steps=_steps(optimizer, batches),
                           callbacks=[losses, *callbacks], **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, losses.values


def _run(rank: int, world_size: int, root: Path) -> dict:
    out: dict = {}
    for optimizer in OPTIMIZERS:
        out[optimizer, "ddp"] = _fit(DDPStrategy(), optimizer)[1]
        for name, stage in STAGES.items():
            trainer, out[optimizer, name] = _fit(ZeroStrategy(stage=stage), optimizer)
            sharded = [trainer.strategy.runtime.sharded(o) for o in trainer.optimizers]
            out["layout", optimizer, name] = [s.sharding for s in sharded]
    monitor = ZeroMonitor()
    trainer, _ = _fit(ZeroStrategy(stage=2), "muon", callbacks=[monitor])
    out["state_bytes"] = [sum(v.numel() * v.element_size() for st in o.state.values() for v in st.values()
                              if torch.is_tensor(v) and v.dim() > 0) for o in trainer.optimizers]
    out["report"] = monitor.report()
    out["muon", "ddp", "bf16"] = _fit(DDPStrategy(), "muon", precision="bf16-mixed")[1]
    out["muon", "zero2", "bf16"] = _fit(ZeroStrategy(stage=2), "muon", precision="bf16-mixed")[1]
    # Resume at the middle from a checkpoint, as DDP resumes from its own.
    for optimizer in ("muon_aux", "adafactor"):
        for name, strategy in (("ddp", DDPStrategy), ("zero3", lambda: ZeroStrategy(stage=3))):
            trainer, _ = _fit(strategy(), optimizer, batches=STEPS // 2)
            trainer.save_checkpoint(root / f"{optimizer}-{name}-half.ckpt")
            out["resumed", optimizer, name] = _fit(strategy(), optimizer,
                                                   ckpt_path=root / f"{optimizer}-{name}-half.ckpt")[1]
    out["refused", "rows"] = _error(lambda: _fit(ZeroStrategy(stage=2, optimizer_sharding="rows"), "adafactor"))
    out["refused", "offload"] = _error(lambda: _fit(ZeroStrategy(stage=2, offload_optimizer="cpu"), "lars"))
    return out


def _reload_at_one_rank(rank: int, world_size: int, root: Path) -> dict:
    """The zero3 checkpoint of the 2-rank run, loaded by one rank under zero1: what its optimizer and module hold."""
    trainer, _ = _fit(ZeroStrategy(stage=1), "muon_aux", batches=STEPS // 2, world_size=1,
                      ckpt_path=root / "muon_aux-zero3-half.ckpt")
    optimizer = trainer.optimizers[0]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {"state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
                      for i, p in enumerate(params) if p in optimizer.state},
            "params": {n: p.detach().clone() for n, p in trainer.lightning_module.named_parameters()}}


@lru_cache(maxsize=None)
def results(root: str) -> tuple[list[dict], dict, Path]:
    two = run_on_ranks(lambda r, w: _run(r, w, Path(root)), 2)
    one = run_on_ranks(lambda r, w: _reload_at_one_rank(r, w, Path(root)), 1)[0]
    return two, one, Path(root)


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return results(str(tmp_path_factory.mktemp("optimizers")))


@pytest.mark.parametrize("name", STAGES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_matrix_optimizers_give_ddps_losses(per_rank, optimizer: str, name: str) -> None:
    for rank in per_rank[0]:
        got, want = rank[optimizer, name], rank[optimizer, "ddp"]
        assert len(want) == STEPS and want[0] != want[-1]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)
        expected = ["params", "rows"] if optimizer == "muon" else ["params"]  # AdamW keeps rows
        assert rank["layout", optimizer, name] == expected


def test_bf16_mixed_muon_within_bf16_rounding(per_rank) -> None:
    for rank in per_rank[0]:
        got, want = rank["muon", "zero2", "bf16"], rank["muon", "ddp", "bf16"]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=0)


@pytest.mark.parametrize("optimizer", ["muon_aux", "adafactor"])
def test_resume_from_the_middle_as_ddp_resumes(per_rank, optimizer: str) -> None:
    """The first step after the resume (Lightning restarts the data where DDP does) has the uninterrupted run's loss,
    and every step DDP's resumed run's: the whole-parameter optimizer states came back on their owners."""
    for rank in per_rank[0]:
        resumed, ddp = rank["resumed", optimizer, "zero3"], rank["resumed", optimizer, "ddp"]
        assert len(resumed) == STEPS // 2 and resumed[0] == pytest.approx(rank[optimizer, "zero3"][STEPS // 2])
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(ddp), rtol=1e-4, atol=0)


def test_a_zero3_checkpoint_loads_at_one_rank_under_zero1(per_rank) -> None:
    _, one, root = per_rank
    saved = torch.load(root / "muon_aux-zero3-half.ckpt", weights_only=False, map_location="cpu")
    states = saved["optimizer_states"][0]["state"]
    assert len(states) == len(one["state"]) > 0
    for position, entry in states.items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                torch.testing.assert_close(one["state"][position][key], value, rtol=0, atol=0)
            else:
                assert one["state"][position][key] == value
    for name, got in one["params"].items():
        torch.testing.assert_close(got, saved["state_dict"][name], rtol=0, atol=0)


def test_what_ownership_cannot_do_is_refused_in_one_line(per_rank) -> None:
    rank = per_rank[0][0]
    assert rank["refused", "rows"].startswith("ValueError: optimizer_sharding='rows' cannot step Adafactor")
    assert rank["refused", "offload"].startswith("ValueError: LARS owns whole parameters")


def test_owned_state_bytes_per_rank_are_the_estimates(per_rank) -> None:
    """Muon's momentum (4 bytes an element) on the matrices each rank owns, AdamW's two moments (8 bytes) on its rows
    of the rest: each rank's measured optimizer state within 10% of that, and the run report states them."""
    model = GPT2("muon")
    matrices, rest = model._groups()
    owned = owned_elements([p.shape for p in matrices], 2)
    for rank, out in enumerate(per_rank[0]):
        adamw = sum(8 * ShardSpec(p.shape, rank, 2).local_numel for p in rest)
        muon, adam_measured = out["state_bytes"]
        assert muon == pytest.approx(4 * owned[rank], rel=0.1) and adam_measured == pytest.approx(adamw, rel=0.1)
        line = next(line for line in out["report"].splitlines() if "whole parameters owned" in line)
        assert "the largest" in line
