"""Stage 3 large-model init: a model built in ``configure_model`` is never held in full by any rank.

Peak resident memory is read from the kernel (``VmHWM``, reset through ``/proc/self/clear_refs``) around Lightning's
configure_model + strategy setup, and compared with the model's full size.
"""

from __future__ import annotations

import ctypes
from contextlib import nullcontext
from functools import lru_cache
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_zero import ZeroStrategy
from tests.harness import run_on_ranks
from tests.models import make_trainer

WIDTH, LAYERS = 1024, 16  # 16.8M parameters: 64 MiB in fp32
FULL_BYTES = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
M_MMAP_THRESHOLD = -3


class BigMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = None

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))

    def training_step(self, batch, batch_idx):
        return self.layers(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, WIDTH)), batch_size=4)


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class PeakDuringSetup(pl.Callback):
    def setup(self, trainer, pl_module, stage):
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current resident size
        self.baseline = _kib("VmRSS:")

    def on_fit_start(self, trainer, pl_module):
        self.peak = _kib("VmHWM:") - self.baseline
        with trainer.strategy.gathered_parameters() if isinstance(trainer.strategy, ZeroStrategy) else nullcontext():
            self.first_weights = pl_module.layers[0].weight.detach().clone()


def _measure(rank: int, world_size: int) -> dict:
    # glibc raises its mmap threshold after large frees and then keeps freed blocks resident, which would count
    # memory the program already released; a fixed 1 MiB threshold makes resident memory follow live tensors.
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    out = {}
    for name, strategy in [("zero3", ZeroStrategy(3, units=("Linear",))), ("ddp", DDPStrategy())]:
        pl.seed_everything(5, verbose=False)
        probe = PeakDuringSetup()
        make_trainer(strategy, world_size, max_steps=1, callbacks=[probe]).fit(BigMLP())
        out[name] = (probe.peak, probe.first_weights)
    return out


@lru_cache(maxsize=None)
def results(world_size: int) -> list[dict]:
    return run_on_ranks(_measure, world_size)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to read peak memory")
def test_setup_peak_is_near_one_shard_not_the_model() -> None:
    world_size = 2
    for per_rank in results(world_size):
        zero3_peak, zero3_weights = per_rank["zero3"]
        ddp_peak, ddp_weights = per_rank["ddp"]
        one_layer = FULL_BYTES / LAYERS
        # The shard (half the model) plus about one layer in full while it is initialized.
        assert zero3_peak <= FULL_BYTES / world_size + 3 * one_layer, (zero3_peak, FULL_BYTES)
        assert ddp_peak >= FULL_BYTES  # the eager build holds it all
        # Same initial values as the eager build from the same seed.
        assert torch.equal(zero3_weights, ddp_weights)


class EagerMLP(BigMLP):
    """The same network built in ``__init__``: the strategy receives it whole."""

    def __init__(self) -> None:
        super().__init__()
        self.configure_model()


class SetupOfBuiltModel(pl.Callback):
    """Resident memory from before the model was built (``start``) to the end of the strategy's setup, and the
    peak of the strategy's setup over what the rank held when it began (Lightning's ``setup`` hook runs just before)."""

    def start(self) -> None:
        self.before_build = _kib("VmRSS:")

    def setup(self, trainer, pl_module, stage):
        Path("/proc/self/clear_refs").write_text("5")
        self.at_setup = _kib("VmRSS:")

    def on_fit_start(self, trainer, pl_module):
        self.setup_peak = _kib("VmHWM:") - self.at_setup
        self.held_after = _kib("VmRSS:") - self.before_build


def _measure_eager(rank: int, world_size: int) -> tuple[int, int]:
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)  # as in _measure
    probe = SetupOfBuiltModel()
    pl.seed_everything(5, verbose=False)
    probe.start()
    module = EagerMLP()
    make_trainer(ZeroStrategy(3, units=("Linear",)), world_size, max_steps=1, callbacks=[probe]).fit(module)
    return probe.setup_peak, probe.held_after


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to read peak memory")
def test_sharding_an_eager_model_frees_each_parameter_as_its_shard_exists() -> None:
    # Sharding adds about one unit (a layer) to the eager copy at its peak, and leaves the shards: keeping the full
    # parameters until every shard exists would add the shards (half the model at 2 ranks) to the eager copy.
    one_layer = FULL_BYTES / LAYERS
    for setup_peak, held_after in run_on_ranks(_measure_eager, 2):
        assert setup_peak <= 2 * one_layer, (setup_peak / 2**20, one_layer / 2**20)
        assert held_after <= 0.75 * FULL_BYTES, (held_after / 2**20, FULL_BYTES / 2**20)  # the copy is gone
