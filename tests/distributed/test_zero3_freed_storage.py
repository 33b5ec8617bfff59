"""Stage 3 frees a unit's gathered parameters after its forward for real: also the views of them that autograd saves
for the backward (``nn.Linear`` saves ``weight.t()``), which kept the whole gathered storage alive from a unit's
forward to its backward (see [Note: how a full parameter is freed and restored], ``sharding/unit_state.py``).

Every storage a full parameter is gathered into is followed by a weak reference; the bytes still held by those alive
are counted before each backward (from the second step the last unit is kept gathered for its backward: one unit's
bytes) and before each optimizer step, 2 ranks, on a stack of Linear units fed 3-d inputs.
"""

from __future__ import annotations

from functools import cache

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.sharding.flat_param import ParamShard
from tests.harness import run_on_ranks
from tests.models import make_trainer

WIDTH, LAYERS, STEPS = 64, 4, 3


class Stack(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(LAYERS)])

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x.view(2, -1, WIDTH)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        data = torch.randn(64, 8 * WIDTH, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=1)


class GatheredBytes(pl.Callback):
    """Bytes of the storages gathered this step that are still alive and hold memory, before the backward and before
    the optimizer step; and the losses."""

    def __init__(self, gathered: list) -> None:
        self.gathered = gathered
        self.before_backward: list[int] = []
        self.before_step: list[int] = []
        self.losses: list[float] = []

    def _held(self) -> int:
        storages = {}
        for ref in self.gathered:
            if not torch.UntypedStorage._expired(ref):
                storage = torch.UntypedStorage._new_with_weak_ptr(ref)
                storages[storage._cdata] = storage.nbytes()
        return sum(storages.values())

    def on_train_batch_start(self, *_args) -> None:
        self.gathered.clear()

    def on_before_backward(self, *_args) -> None:
        self.before_backward.append(self._held())

    def on_before_optimizer_step(self, *_args) -> None:
        self.before_step.append(self._held())

    def on_train_batch_end(self, trainer, pl_module, outputs, *_args) -> None:
        self.losses.append(float(outputs["loss"]))


class ToNumpy(GatheredBytes):
    """Also makes a NumPy array of every full parameter once, inside ``gathered_parameters`` (which makes their
    storage non-resizable)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        super().on_train_batch_start()
        if batch_idx == 1:
            with trainer.strategy.gathered_parameters():
                self.sums = [float(p.detach().numpy().sum()) for p in pl_module.parameters()]


def _run(rank: int, world_size: int) -> dict:
    gathered: list = []
    to_unsharded = ParamShard.to_unsharded

    def following(shard: ParamShard, storage: torch.Tensor) -> None:
        to_unsharded(shard, storage)
        gathered.append(storage.untyped_storage()._weak_ref())  # every parameter is a Linear unit's: the root has none

    ParamShard.to_unsharded = following
    try:
        return _fits(gathered, world_size)
    finally:
        ParamShard.to_unsharded = to_unsharded


def _fits(gathered: list, world_size: int) -> dict:
    out, shapes = {}, {}
    for name, strategy, callback in [
        ("ddp", DDPStrategy(), GatheredBytes),
        ("reshard", ZeroStrategy(3, units=("Linear",)), GatheredBytes),
        ("keep", ZeroStrategy(3, units=("Linear",), reshard_after_forward=False), GatheredBytes),
        ("numpy", ZeroStrategy(3, units=("Linear",)), ToNumpy),
    ]:
        pl.seed_everything(0, verbose=False)
        record = callback(gathered)
        trainer = make_trainer(strategy, world_size, max_steps=STEPS, callbacks=[record])
        model = Stack()
        trainer.fit(model)
        if isinstance(strategy, ZeroStrategy):
            with strategy.gathered_parameters():  # after fit the module holds its full parameters, and keeps them
                pass
        shapes[name] = [tuple(p.shape) for p in model.parameters()]
        out[name] = (record.before_backward, record.before_step, record.losses)
    return out | {"shapes": shapes}


@cache
def results() -> list[dict]:
    return run_on_ranks(_run, 2)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_gathered_storage_is_freed_with_the_views_autograd_saved(reshard_after_forward: bool) -> None:
    unit_bytes = (WIDTH * WIDTH + WIDTH) * 4  # a unit's full parameters, fp32
    for per_rank in results():
        before_backward, before_step, losses = per_rank["reshard" if reshard_after_forward else "keep"]
        # Resharded after its forward, a unit holds nothing until the backward gathers it again, although autograd
        # saved views of its weight: from the second step all but the last unit the forward ran, which stays gathered
        # for the backward it starts; kept, every unit's full parameters are alive when the backward starts.
        expected = [0] + [unit_bytes] * (STEPS - 1) if reshard_after_forward else [LAYERS * unit_bytes] * STEPS
        assert before_backward == expected
        assert before_step == [0] * STEPS  # each unit is freed once its gradients are reduced
        ddp_losses = per_rank["ddp"][2]
        assert len(losses) == STEPS and losses[0] != losses[-1]
        assert losses == pytest.approx(ddp_losses, rel=1e-5)  # the backward read the values gathered again


def test_a_storage_shared_with_numpy_is_left_to_it() -> None:
    # .numpy() of the full parameters at step 1 makes their storages non-resizable: those are dropped, not freed in
    # place, and the next gathers fill new ones; training goes on as under DDP, with nothing held before a backward
    # but the last unit (as in the test above).
    unit_bytes = (WIDTH * WIDTH + WIDTH) * 4
    for per_rank in results():
        before_backward, before_step, losses = per_rank["numpy"]
        assert before_backward == [0] + [unit_bytes] * (STEPS - 1) and before_step == [0] * STEPS
        assert losses == pytest.approx(per_rank["ddp"][2], rel=1e-5)


def test_gathered_parameters_after_fit_leaves_the_full_parameters() -> None:
    full = [(WIDTH, WIDTH), (WIDTH,)] * LAYERS
    for per_rank in results():
        assert per_rank["shapes"] == {"ddp": full, "reshard": full, "keep": full, "numpy": full}
