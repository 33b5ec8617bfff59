"""One CUDA device: optimizer offload to the host (``host``), stage 3's parameter shards on the host too (``params``)
and both on disk (``disk``), each against the same stage without offload, at every step. Skipped without a GPU.

Every run issues its NCCL collectives (``shortcut_single_rank=False``, as tests/gpu/test_cuda.py explains), and the
host step is cut into several groups (``bucket_mb``, ``offload_subgroup_mb``: a few KiB of a ~5,700-parameter model),
so the side-stream copies between device and host run group by group, as on a large model. What is compared:

- against the same stage without offload: the first loss bitwise (the same parameters and kernels on the device
  before any update); every later loss and the parameters after every step within ``RTOL``/``ATOL``, because the
  offloaded step runs torch's fused CPU AdamW on the host and the in-device one CUDA's AdamW, which round differently
  (the tolerance of the CPU offload tests, tests/distributed/test_offload.py; bf16-mixed: ``MIXED_RTOL`` on losses);
- stage 3's three offload modes against one another, bitwise at every step: the same host step on the same values,
  only where the working shards and the states live between steps differs (on this project's CPU the three are
  bitwise equal too; attention runs its math kernel, whose backward, unlike the memory-efficient one's, is
  deterministic). A copy between host and device that raced the step it feeds shows here first;
- where the states live: off the device, at least the fp32 masters and Adam's moments (12Ψ);
- ZeRO++'s qwZ and qgZ with the three modes (one rank, so nothing crosses: the int8 gather and the int4 reduce
  quantize and dequantize this rank's own rows): the modes bitwise alike again, the rows packed from the device, from
  page-locked host rows or from disk offload's unit buffer and quantized on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_zero import ZeroStrategy
from lightning_zero.memory import ModelStateBytes
from tests.models import Recorder, StepSeededLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODES = {
    "host": {"offload_optimizer": "cpu"},
    "params": {"offload_optimizer": "cpu", "offload_params": "cpu"},
    "disk": {"offload_optimizer": "disk", "offload_params": "disk"},
}
#: A few KiB: the host step of the ~22 KiB of fp32 parameters walks several groups (disk: sub-groups).
GROUP_MB = 0.005
RTOL, ATOL = 1e-5, 1e-6
MIXED_RTOL = 3e-3
STEPS = 8


@dataclass(frozen=True)
class Run:
    losses: list[float]
    params: list[torch.Tensor]
    held: ModelStateBytes
    collectives: int
    #: The kinds of collective issued (``CommStats.by_op``'s keys).
    ops: frozenset[str]


class _Held(pl.Callback):
    """What the strategy holds where, at the third step (optimizer states exist from the first step on)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 2:
            self.held = trainer.strategy.model_state_bytes()


@lru_cache(maxsize=None)
def _fit(stage: int, mode: str | None, precision: str = "32-true", steps: int = STEPS, zeropp: bool = False) -> Run:
    options = dict(MODES[mode]) if mode is not None else {}
    if zeropp:
        options |= {"quantize_weights": True, "quantize_grads": "int4"}
    strategy = ZeroStrategy(stage=stage, shortcut_single_rank=False, bucket_mb=GROUP_MB, offload_subgroup_mb=GROUP_MB,
                            units=("Block",) if stage == 3 else (), **options)
    pl.seed_everything(11, verbose=False)
    recorder, held = Recorder(), _Held()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cuda", devices=1, max_steps=steps, precision=precision,
        callbacks=[recorder, held], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    with sdpa_kernel(SDPBackend.MATH):  # the memory-efficient kernel's backward is not deterministic
        trainer.fit(StepSeededLM())
    stats = trainer.strategy.comm_stats
    return Run(recorder.losses, [p.cpu() for p in recorder.params], held.held, stats.total_calls, frozenset(stats.by_op))


CASES = [(1, "host"), (2, "host"), (3, "host"), (3, "params"), (3, "disk")]
IDS = [f"zero{stage}-{mode}" for stage, mode in CASES]


@pytest.mark.parametrize(("stage", "mode"), CASES, ids=IDS)
def test_fp32_offload_matches_the_same_stage_every_step(stage: int, mode: str) -> None:
    want, got = _fit(stage, None), _fit(stage, mode)
    assert len(got.losses) == len(want.losses) == len(got.params) == len(want.params) == STEPS
    assert got.collectives > 0 and want.collectives > 0  # the NCCL collectives were issued
    assert got.losses[0] == want.losses[0]
    np.testing.assert_allclose(got.losses, want.losses, rtol=RTOL)
    for step, (a, b) in enumerate(zip(got.params, want.params)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step}: {m}")
    assert not torch.equal(got.params[0], got.params[-1])  # it trained


@pytest.mark.parametrize("mode", ["params", "disk"])
def test_stage3_offload_modes_take_the_same_host_step_bitwise(mode: str) -> None:
    want, got = _fit(3, "host"), _fit(3, mode)
    assert got.losses == want.losses
    for step, (a, b) in enumerate(zip(got.params, want.params)):
        assert torch.equal(a, b), f"step {step}: {mode} differs from host offload by {(a - b).abs().max():.3g}"


@pytest.mark.parametrize("mode", ["host", "params", "disk"])
def test_qwz_and_qgz_with_each_offload_mode_quantize_on_the_device_alike(mode: str) -> None:
    """The same run on this project's CPU (one gloo rank) gives the three modes bitwise alike, losses within 3.2% of
    the unquantized run's over the 8 steps."""
    want, got, plain = _fit(3, "host", zeropp=True), _fit(3, mode, zeropp=True), _fit(3, "host")
    assert {"all_gather_quantized", "reduce_scatter_quantized"} <= got.ops and "reduce_scatter" not in got.ops
    assert got.losses == want.losses
    for step, (a, b) in enumerate(zip(got.params, want.params)):
        assert torch.equal(a, b), f"step {step}: {mode} differs from host offload by {(a - b).abs().max():.3g}"
    assert got.losses[0] != plain.losses[0]  # the first forward's weights were quantized
    np.testing.assert_allclose(got.losses, plain.losses, rtol=0.1)


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_mixed_host_offload_tracks_the_same_stage(stage: int) -> None:
    want, got = _fit(stage, None, "bf16-mixed", 12), _fit(stage, "host", "bf16-mixed", 12)
    assert len(got.losses) == 12 and got.losses[0] == want.losses[0]
    relative = np.abs(np.array(got.losses) - np.array(want.losses)) / np.abs(np.array(want.losses))
    assert relative.max() < MIXED_RTOL


@pytest.mark.parametrize(("stage", "mode"), CASES, ids=IDS)
def test_offloaded_states_live_off_the_device(stage: int, mode: str) -> None:
    # fp32, one rank, Ψ parameters, in bytes: without offload the device holds parameters, gradients, and Adam's two moments
    # (16Ψ); offloaded, the fp32 masters and the moments (12Ψ) are on the host or on disk (params, disk: the working
    # shards too), and the device keeps what compute needs (8Ψ; the gradient shards alone, 4Ψ, with offload_params).
    psi = _fit(stage, mode).params[0].numel()
    base, held = _fit(stage, None).held, _fit(stage, mode).held
    assert base.host == base.disk == 0 and base.device == pytest.approx(16 * psi, rel=0.05)
    away = held.disk if mode == "disk" else held.host
    assert away >= 12 * psi
    assert held.device <= (4 if mode in ("params", "disk") else 8) * psi * 1.05
