"""The launching process never initializes CUDA: Lightning forks the ranks of ``zero3_fork`` and the ``_notebook``
strategies from it, and cannot once CUDA is initialized there. Without a GPU, ``torch.cuda`` is faked as a machine
with 2 GPUs before CUDA is initialized: counting devices works (through NVML, as on a real one), and every call that
would initialize CUDA is recorded and marks it initialized. Under ``Trainer.init_module()`` a stage-3 model is built
on the meta device with the CUDA generator recorded as a seed (sharding/materialize.py, [Note: the CUDA generator of
a process without CUDA]); ``strategy=auto`` reads the GPUs' free memory through NVML."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_zero import ZeroStrategy, auto
from lightning_zero.auto import AUTO_ENV, AutoStrategy
from lightning_zero.models.language_model import ParameterCounts
from lightning_zero.sharding.materialize import generator_state, rng_state

GIB = 2**30


class UninitializedCuda:
    """``torch.cuda`` of a process on a machine with ``devices`` GPUs that has not initialized CUDA yet."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, devices: int = 2) -> None:
        #: The calls made that initialize CUDA, in order.
        self.initializing: list[str] = []
        monkeypatch.setattr(torch.cuda, "_initialized", False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)  # NVML-based under Lightning
        answers = {
            "init": lambda: None,
            "current_device": lambda: 0,
            "set_device": lambda device: None,
            "synchronize": lambda device=None: None,
            "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
            "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8)] * devices,
            "initial_seed": lambda: 0,
            "get_device_properties": lambda device=None: SimpleNamespace(total_memory=80 * GIB, name="fake"),
            "get_device_capability": lambda device=None: (9, 0),
            "get_device_name": lambda device=None: "fake",
            "mem_get_info": lambda device=None: (80 * GIB, 80 * GIB),
            "device_memory_used": lambda device=None: 0,
        }
        for name, answer in answers.items():
            monkeypatch.setattr(torch.cuda, name, self._initializing(name, answer))

    def _initializing(self, name: str, answer):
        def call(*args, **kwargs):
            self.initializing.append(name)
            torch.cuda._initialized = True
            return answer(*args, **kwargs)

        return call


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> UninitializedCuda:
    return UninitializedCuda(monkeypatch)


def test_init_module_builds_a_stage3_model_without_initializing_cuda(cuda: UninitializedCuda) -> None:
    pl.seed_everything(7, verbose=False)
    trainer = pl.Trainer(strategy=ZeroStrategy(stage=3, start_method="fork"), accelerator="cuda", devices=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert trainer.strategy.root_device == torch.device("cuda", 0)
    with trainer.init_module():
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    assert all(p.is_meta for p in model.parameters())
    assert cuda.initializing == [] and not torch.cuda.is_initialized()
    assert trainer.strategy._init_rng_state == 7  # the seed the CUDA generators start from, made a state in setup


def test_strategy_auto_reads_free_gpu_memory_without_initializing_cuda(
    cuda: UninitializedCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NVML says 20 GiB are free on each GPU. fp32 Adam, 2e9 parameters on 2 ranks: DDP would hold 16Ψ (29.8 GiB)
    # and zero1 12Ψ (22.4 GiB), zero2 with its 25 MiB bucket 10Ψ (18.6 GiB): zero2 is the least complex that fits.
    monkeypatch.delenv(AUTO_ENV, raising=False)
    read: list[int] = []
    monkeypatch.setattr(auto, "_nvml_free_bytes", lambda device: read.append(device) or 20 * GIB)
    counts = ParameterCounts(total=2 * 10**9, trainable=2 * 10**9)
    choice = auto.choose(AutoStrategy(offload=False), counts, "32-true", accelerator="cuda", devices=2)
    assert choice.option == "zero2" and read == [0, 1]
    assert cuda.initializing == [] and not torch.cuda.is_initialized()


def test_setup_makes_the_recorded_seed_the_state_of_a_generator_seeded_with_it() -> None:
    # The CPU's generator stands for a CUDA device's here (tests/gpu checks the CUDA one against torch.cuda).
    torch.manual_seed(7)
    seeded = torch.random.get_rng_state()
    torch.manual_seed(8)
    assert torch.equal(generator_state(torch.device("cpu"), 7), seeded)
    assert torch.equal(generator_state(torch.device("cpu"), seeded), seeded)  # a state read is kept as it is
    assert torch.equal(rng_state(torch.device("cpu")), torch.random.get_rng_state())
