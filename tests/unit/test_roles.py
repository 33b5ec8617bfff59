"""Every part the runtime composes provides its role's whole contract (sharding/roles.py), with the same parameters:
the runtime calls nothing else on them."""

from __future__ import annotations

import inspect

import pytest

from lightning_zero.offload.disk import DiskOffload
from lightning_zero.offload.host import HostOffload
from lightning_zero.sharding.grad_hooks import GradReducer
from lightning_zero.sharding.param_hooks import ShardedParams
from lightning_zero.sharding.replicated import ReplicatedParams
from lightning_zero.sharding.roles import GradientRole, Offload, ParameterRole
from lightning_zero.sharding.single_rank import SingleRank


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
