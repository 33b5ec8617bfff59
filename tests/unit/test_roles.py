"""Every part the runtime composes provides its role's whole contract (sharding/roles.py), with the same parameters:
the runtime calls nothing else on them; and does its role's work: composed as the runtime composes it, each trains as
DDP does, and one whose method is replaced by a stub that does nothing fails."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from lightning_zero.offload.disk import DiskOffload
from lightning_zero.offload.host import HostOffload
from lightning_zero.sharding.grad_hooks import GradReducer
from lightning_zero.sharding.param_hooks import ShardedParams
from lightning_zero.sharding.replicated import ReplicatedParams
from lightning_zero.sharding.roles import GradientRole, Offload, ParameterRole
from lightning_zero.sharding.single_rank import SingleRank
from tests.models import ParityModel, Recorder, make_trainer


def _members(protocol: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(value) for name, value in vars(protocol).items()
            if callable(value) and not name.startswith("_")}


@pytest.mark.parametrize(
    ("protocol", "implementation"),
    [
        (ParameterRole, ReplicatedParams), (ParameterRole, ShardedParams), (ParameterRole, SingleRank),
        (GradientRole, GradReducer), (GradientRole, ShardedParams), (GradientRole, SingleRank),
        (Offload, HostOffload), (Offload, DiskOffload),
    ],
)
def test_each_part_provides_its_whole_role(protocol: type, implementation: type) -> None:
    members = _members(protocol)
    assert len(members) >= 5
    for name, wanted in members.items():
        assert hasattr(implementation, name), f"{implementation.__name__} has no {name}"
        got = inspect.signature(getattr(implementation, name))
        want_params = [p.name for p in wanted.parameters.values() if p.kind is not p.VAR_KEYWORD]
        got_params = [p.name for p in got.parameters.values() if p.kind is not p.VAR_KEYWORD]
        if "self" not in got_params:  # a staticmethod: the protocol's self is the instance
            want_params = want_params[1:]
        assert got_params == want_params, (implementation.__name__, name, got_params, want_params)


# Behaviour: the names and signatures above hold for a class of stubs too. Each part is composed here as the runtime
# composes it (one rank in this process; offload makes the runtime compose the multi-rank roles over a world of one,
# whose collectives are local copies) and must train as DDP does, bitwise; a part whose method does nothing fails.
ROLE_CASES = {
    "single rank": ({"stage": 2}, (SingleRank, SingleRank, type(None))),
    "stage 1": ({"stage": 1, "offload_optimizer": "cpu"}, (ReplicatedParams, GradReducer, HostOffload)),
    "stage 2": ({"stage": 2, "offload_optimizer": "cpu"}, (ReplicatedParams, GradReducer, HostOffload)),
    "stage 3": ({"stage": 3, "units": ("Linear",), "offload_optimizer": "cpu"},
                (ShardedParams, ShardedParams, HostOffload)),
    "stage 3 disk": ({"stage": 3, "units": ("Linear",), "offload_optimizer": "disk", "offload_params": "disk"},
                     (ShardedParams, ShardedParams, DiskOffload)),
}
STEPS = 3


class _Parts(pl.Callback):
    """The classes of the parts the runtime composed, seen during fit."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        runtime = trainer.strategy.runtime
        self.classes = (type(runtime.parameters), type(runtime.gradients), type(runtime.offload))


def _fit(strategy, parts: pl.Callback | None = None) -> list[torch.Tensor]:
    pl.seed_everything(5, verbose=False)
    model = ParityModel("sgd")  # foreach=False where offload steps: torch's single-tensor loop, as the reference's
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    recorder = Recorder()
    make_trainer(strategy, 1, max_steps=STEPS, callbacks=[recorder, *([parts] if parts else [])]).fit(model)
    return recorder.params


@pytest.fixture(scope="module")
def reference() -> list[torch.Tensor]:
    return _fit(DDPStrategy())  # DDP over a world of one, the same data and seed as every case


def _trains_as_ddp(options: dict, reference: list[torch.Tensor], parts: pl.Callback | None = None) -> bool:
    try:
        got = _fit(ZeroStrategy(**options), parts)
    except Exception:  # noqa: BLE001 - a part that fails to do its work may fail loudly too
        return False
    return len(got) == STEPS and all(torch.equal(g, w) for g, w in zip(got, reference))


@pytest.mark.parametrize("case", list(ROLE_CASES))
def test_each_part_does_its_roles_work(case: str, reference: list[torch.Tensor], tmp_path) -> None:
    options, classes = ROLE_CASES[case]
    if "offload_params" in options:
        options = {**options, "offload_dir": str(tmp_path)}
    parts = _Parts()
    assert _trains_as_ddp(options, reference, parts)
    assert parts.classes == classes


#: A method of a part replaced by one that does nothing: the parts' work must then be missed. Over a world of one,
#: ``ReplicatedParams``' work is nothing (a rank's rows are the whole parameter, which the update writes in place):
#: the distributed parity tests (each stage against DDP on 2 and 4 ranks) are what catch it doing nothing.
STUBBED = [
    ("stage 2", GradReducer, "post_backward"),
    ("stage 3", ShardedParams, "begin_step"),
    ("stage 3", ShardedParams, "post_backward"),
    ("stage 2", HostOffload, "update"),
    ("stage 3 disk", DiskOffload, "update"),
]


@pytest.mark.parametrize(("case", "part", "method"), STUBBED)
def test_a_part_whose_method_does_nothing_is_caught(case, part, method, reference, tmp_path, monkeypatch) -> None:
    options = ROLE_CASES[case][0]
    if "offload_params" in options:
        options = {**options, "offload_dir": str(tmp_path)}
    monkeypatch.setattr(part, method, lambda self, *args, **kwargs: None)
    assert not _trains_as_ddp(options, reference)
