"""The parity that matters, with ranks as users launch them: separate interpreters, ``PYTHONHASHSEED`` unset.

The distributed tests fork their ranks, which then share addresses and a hash seed, and so every order a set or an
``id()`` gives. Here one launch of 2 CPU ranks (gloo) per launcher, torchrun and Lightning's default popen launcher,
runs tests/integration/launcher_job.py: DDP, zero1, zero2 and zero3 on a model with parameters of four dtypes, in fp32
and bf16-mixed, ``gathered_gradients()`` before every step, the release of the full parameters at the end of fit, and
a save at step 3 resumed to step 6, gradient norms read on rank 0 alone and a user's ``AveragedModel``. In a
launch whose ranks iterate a set of dtypes in different orders (the job records each rank's), a loop that issued one gather per dtype in a set's order failed (see [Note: how the order of
collectives is owned] in lightning_zero/sharding/collectives.py): measured with the two loops d127bf2 fixed put
back, 5 of 6 launches aborted with gloo's ``collective mismatch``. Each launch costs 15-30 s on 2 busy cores.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from tests.integration.launcher_job import PRECISIONS, SAVED_AT, STAGES, STEPS

JOB = Path(__file__).with_name("launcher_job.py")
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(JOB)],
    "popen": [sys.executable, str(JOB)],  # Lightning runs the script again for rank 1
}
ENVIRONMENTS = {"torchrun": "TorchElasticEnvironment", "popen": "LightningEnvironment"}
# fp32: as tests/distributed/test_parity.py (exactly equal at 2 ranks, measured). bf16-mixed: losses within 3e-3
# relative, as the other mixed-precision tests; gradients (ZeRO's are bf16, DDP's fp32) and parameters (ZeRO's
# working copies are bf16) as the norm of the difference relative to DDP's, measured at most 6.6e-3 and 1.9e-3, where
# 6 steps move the parameters by 6.3e-2.
RTOL, ATOL = 1e-5, 1e-6
MIXED_LOSS_RTOL, MIXED_GRAD_RTOL, MIXED_PARAM_RTOL = 3e-3, 2e-2, 1e-2
TIMEOUT_S = 300


def launch(launcher: str, root: str) -> list[dict]:
    """Every rank's results of the one launch under ``launcher``, in rank order; a failed launch fails every test
    that reads it, with its output, without launching again."""
    outcome = _launch(launcher, root)
    if isinstance(outcome, str):
        pytest.fail(outcome, pytrace=False)
    return outcome


@lru_cache(maxsize=None)
def _launch(launcher: str, root: str) -> list[dict] | str:
    """Run the job under ``launcher`` in a clean environment: every rank's results, or what the launch printed."""
    out = Path(root) / launcher
    out.mkdir()
    # Lightning's launchers in this process (other tests) leave MASTER_PORT, LOCAL_RANK and PL_* behind; a hash seed
    # set for the suite would give every rank the same set orders of strings.
    leaked = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
              "LOCAL_WORLD_SIZE", "PYTHONHASHSEED")
    env = {k: v for k, v in os.environ.items() if k not in leaked and not k.startswith("PL_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    job = subprocess.Popen([*LAUNCHERS[launcher], str(out), launcher], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = job.communicate(timeout=TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        _end(job)
        output = job.communicate()[0]
    # gloo's abort of a mismatched collective ("collective mismatch") is printed long before the launcher's summary.
    if job.returncode != 0:
        errors = [line for line in output.splitlines() if "Error" in line or "what()" in line][:12]
        return "\n".join([f"{launcher} launch failed (exit {job.returncode}):", *errors, "...", output[-4000:]])
    return [torch.load(out / f"{launcher}-rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def _end(job: subprocess.Popen) -> None:
    """End a launch that ran out of time: SIGTERM first, on which torchrun ends the ranks it started in sessions of
    their own; then SIGKILL to the launch's session (the launcher and, under popen, the rank Lightning started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        job.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("launchers"))


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_ranks_are_separate_interpreters_without_a_hash_seed(root: str, launcher: str) -> None:
    ranks = [r["launch"] for r in launch(launcher, root)]
    assert [(r["global_rank"], r["world_size"], r["environment"]) for r in ranks] == [
        (0, 2, ENVIRONMENTS[launcher]), (1, 2, ENVIRONMENTS[launcher])]
    assert ranks[0]["pid"] != ranks[1]["pid"] and [r["hash_seed"] for r in ranks] == [None, None]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", STAGES)
def test_matches_ddp_every_step(root: str, launcher: str, precision: str, stage: int) -> None:
    for rank, per_rank in enumerate(launch(launcher, root)):
        want, got = per_rank[precision, "ddp"], per_rank[precision, stage]
        where = f"rank {rank} (set order {per_rank['launch']['set_order']})"
        assert len(got["losses"]) == len(got["grads"]) == len(got["params"]) == len(want["params"]) == STEPS
        steps = [("gradients", a, b, step) for step, (a, b) in enumerate(zip(got["grads"], want["grads"]))]
        steps += [("parameters", a, b, step) for step, (a, b) in enumerate(zip(got["params"], want["params"]))]
        steps += [("parameters after fit", got["final"], want["final"], STEPS)]
        if precision == "32-true":
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=RTOL, atol=ATOL)
            for what, a, b, step in steps:
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} {what} {step}: {m}")
        else:
            losses = [abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"])]
            assert max(losses) < MIXED_LOSS_RTOL, (where, losses)
            for what, a, b, step in steps:
                bound = MIXED_GRAD_RTOL if what == "gradients" else MIXED_PARAM_RTOL
                assert a.shape == b.shape and _relative(a, b) < bound, (where, what, step, _relative(a, b))
        assert not torch.equal(got["params"][0], got["params"][-1])  # it trains


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", STAGES)
def test_rank_zero_reads_and_a_users_average_are_ddps(root: str, launcher: str, precision: str, stage: int) -> None:
    """Norms read on rank 0 alone (no collective: a hang before issue 52) and a user's ``AveragedModel`` (a deep
    copy of a zero3 model: refused in a gathered scope before issue 52) give DDP's values."""
    ranks = launch(launcher, root)
    want, got = ranks[0][precision, "ddp"], ranks[0][precision, stage]
    assert len(got["rank_zero_norms"]) == STEPS and ranks[1][precision, stage]["rank_zero_norms"] == []
    fp32 = precision == "32-true"
    torch.testing.assert_close(torch.tensor(got["rank_zero_norms"]), torch.tensor(want["rank_zero_norms"]),
                               rtol=RTOL if fp32 else MIXED_GRAD_RTOL, atol=ATOL)
    for per_rank in ranks:
        want, got = per_rank[precision, "ddp"]["average"], per_rank[precision, stage]["average"]
        assert not torch.equal(want, per_rank[precision, "ddp"]["final"])  # an average, not the last weights
        if fp32:
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        else:
            assert _relative(got, want) < MIXED_PARAM_RTOL, _relative(got, want)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_ranks_hold_the_same_model_after_fit(root: str, launcher: str) -> None:
    first, second = launch(launcher, root)
    for key, value in first.items():
        if key != "launch":
            assert torch.equal(value["final"], second[key]["final"]), key


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("stage", STAGES)
def test_save_and_resume_equals_an_uninterrupted_run(root: str, launcher: str, stage: int) -> None:
    for per_rank in launch(launcher, root):
        whole, resumed = per_rank["bf16-mixed", stage], per_rank["resumed", stage]
        assert resumed["losses"] == whole["losses"][SAVED_AT:]  # bitwise, as tests/distributed/test_checkpoints.py
        assert all(torch.equal(a, b) for a, b in zip(resumed["params"], whole["params"][SAVED_AT:]))
        assert torch.equal(resumed["final"], whole["final"])
