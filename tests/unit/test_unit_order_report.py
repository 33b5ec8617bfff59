"""A model with more units than the unit-order board names checks their order over the control channel: said once,
on rank 0, naming the unit count, the limit and the cost (it switched channel silently)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_zero.sharding.unit_order import MAX_UNITS, SharedBoard, unit_order_channel


def _comms(local: bool = False) -> SimpleNamespace:
    return SimpleNamespace(local=local, open_control_channel=lambda: None)


def test_a_model_over_the_boards_units_is_reported_once_naming_count_limit_and_cost(monkeypatch) -> None:
    opened = []
    monkeypatch.setattr(SharedBoard, "open", staticmethod(lambda comms, timeout_s: opened.append(comms) or "board"))
    comms = _comms()
    with pytest.warns(UserWarning) as caught:
        assert unit_order_channel(comms, MAX_UNITS + 1, None) is comms
    assert [str(w.message) for w in caught] == [
        f"zero3: the model has {MAX_UNITS + 1} units, more than the {MAX_UNITS} the unit-order board names, so the "
        "unit-order check (verify_unit_order) exchanges over the gloo control channel instead of shared memory: one "
        "all-gather per unit collective (about 9% of a step's CPU time and 11% of its wall time at M-2); fewer, "
        "larger units (units=, unit_mb=) keep the board, verify_unit_order=False drops the check"
    ]
    assert opened == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # at the limit: the board, and nothing to say
        assert unit_order_channel(comms, MAX_UNITS, None) == "board"
        assert unit_order_channel(_comms(local=True), MAX_UNITS + 1, None).local  # one rank: no check to move
    assert opened == [comms]


def test_the_report_is_made_on_rank_0_only(monkeypatch) -> None:
    monkeypatch.setattr(SharedBoard, "open", staticmethod(lambda comms, timeout_s: None))
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unit_order_channel(_comms(), MAX_UNITS + 1, None)
