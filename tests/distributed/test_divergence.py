"""zero3 with control flow that differs between ranks: every unit gather is a collective, so a rank that skips a unit
would leave the others waiting (NCCL hangs for the process-group timeout, gloo aborts the process). The ranks check
which unit they move for each unit collective and fail, on every rank, naming both units, before waiting on it.

A rank waits for that check before issuing only where it leaves the sequence of the steps before; otherwise the check
runs beside the collective (param_hooks.py, [Note: ranks that run different units]). Both paths are tested: a branch
taken from the first step, and one taken after the ranks have settled into checking beside the collectives.

There a rank has already issued the collective its peer will never match: under NCCL it would spin until the
process-group timeout, so each rank aborts the group before raising (collectives.py, [Note: ending collectives no
peer will match]). With NCCL faked on gloo (the group's device served by "nccl", gloo's algorithms still running,
``ProcessGroup.abort`` recorded instead of done), every rank aborts once before its error propagates; on gloo none.

The ranks exchange through the shared-memory board where they share a host (these tests' ranks do), else through the
gloo control channel (unit_order.py, [Note: the unit-order board]): each case runs over both."""

from __future__ import annotations

import sys
import time
import warnings
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_zero import ZeroStrategy
from lightning_zero.sharding import param_hooks
from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.unit_order import SharedBoard
from lightning_zero.sharding.unit_state import RankDivergenceError
from tests.harness import run_on_ranks
from tests.models import TinyLM, make_trainer


class SkipsABlockOnRank1(TinyLM):
    def __init__(self, from_step: int | None, skipped: int = 0) -> None:
        super().__init__()
        self.from_step, self.skipped = from_step, skipped

    def forward(self, tokens):
        x = self.lm["wte"](tokens) + self.lm["wpe"](torch.arange(tokens.shape[1]))
        skip = self.from_step is not None and self.global_rank == 1 and self.global_step >= self.from_step
        blocks = self.lm["blocks"]
        for block in (blocks[self.skipped + 1 :] if self.skipped == 0 else blocks[: self.skipped]) if skip else blocks:
            x = block(x)
        return self.lm["head"](self.lm["ln_f"](x))


CHANNELS = {"board": SharedBoard, "gloo": Collectives}
SETTLED = 3  # the first step whose unit collectives are checked beside them (see _cases)


def _use_channel(channel: str) -> type:
    """Make this rank's zero3 check exchange through ``channel``; the class whose exchanges it then makes."""
    if channel == "gloo":
        param_hooks.unit_order_channel = lambda comms, units, timeout: (comms.open_control_channel(), comms)[1]
    return CHANNELS[channel]


def _count_exchanges(monkeypatch_target: type) -> dict[str, int]:
    """Count control exchanges waited for before issuing ("first") and checked beside the collective ("beside")."""
    counts = {"first": 0, "beside": 0}
    exchange, exchange_async = monkeypatch_target.exchange, monkeypatch_target.exchange_async

    def counted_exchange(self, values):
        counts["first"] += 1
        return exchange(self, values)

    def counted_async(self, values):
        counts["beside"] += 1
        return exchange_async(self, values)

    monkeypatch_target.exchange, monkeypatch_target.exchange_async = counted_exchange, counted_async
    return counts


def _fit(from_step: int | None, world_size: int, steps: int, skipped: int = 0) -> None:
    pl.seed_everything(1, verbose=False)
    trainer = make_trainer(ZeroStrategy(stage=3, units=("Block",)), world_size, max_steps=steps, limit_val_batches=0)
    trainer.fit(SkipsABlockOnRank1(from_step, skipped))


def _cases(rank: int, world_size: int, from_step: int, channel: str) -> None:
    counts = _count_exchanges(_use_channel(channel))
    _fit(None, world_size, steps=5)  # no branch: the first three steps check first, the next two beside
    # Every exchange goes through exchange_async, a waited one too. The first step has one more unit collective than
    # the next (the last block is gathered again for backward: no step before says it runs last), so the second
    # step's sequence differs and the third is the first that follows a repeated one. At the end of fit one more
    # exchange (waited) agrees on the user's copies of the model (none here: sharding/user_copies.py), on the control
    # channel whatever the check's channel: counted here where that is the channel.
    extra = 1 + (channel == "gloo")
    per_step = (counts["beside"] - extra) // 5
    expected = {"first": 3 * per_step + extra, "beside": 5 * per_step + extra}
    assert counts == expected and per_step > 0, f"control exchanges {counts}, expected {expected}"
    _fit(from_step, world_size, steps=4)


@pytest.mark.parametrize("channel", list(CHANNELS))
@pytest.mark.parametrize("from_step", [0, SETTLED], ids=["first-step", "after-settling"])
def test_ranks_running_different_units_fail_fast_naming_both(from_step: int, channel: str) -> None:
    started = time.perf_counter()
    with pytest.raises(AssertionError) as err:
        run_on_ranks(lambda rank, world_size: _cases(rank, world_size, from_step, channel), 2, timeout_s=60)
    message = str(err.value)
    assert "RankDivergenceError: ranks diverged under zero3" in message
    assert "unit 'lm.blocks.1'" in message and "unit 'lm.blocks.0'" in message
    assert time.perf_counter() - started < 30


def _diverge_recording_aborts(from_step: int, world_size: int, nccl: bool, channel: str) -> tuple[str, list[bool]]:
    """The error this rank's divergent fit raised, and for each group abort, whether no exception was propagating yet
    (``ProcessGroup.abort`` recorded, not done: the fork ends after this fit)."""
    _use_channel(channel)
    aborts: list[bool] = []
    dist.ProcessGroup.abort = lambda group: aborts.append(sys.exc_info() == (None, None, None))
    if nccl:
        init = Collectives.__init__

        def served_by_nccl(self, *args, **kwargs) -> None:
            init(self, *args, **kwargs)
            self.device_backend = "nccl"  # only the backend flag: the algorithms stay gloo's (self.native)

        Collectives.__init__ = served_by_nccl
    try:
        _fit(from_step, world_size, steps=4)
    except RankDivergenceError as err:
        return str(err).split(":")[0], aborts
    raise AssertionError("the fit did not raise RankDivergenceError")


@pytest.mark.parametrize(
    ("from_step", "backend"),
    [(0, "nccl"), (SETTLED, "nccl"), (SETTLED, "gloo")],
    ids=["first-step-nccl", "after-settling-nccl", "after-settling-gloo"],
)
@pytest.mark.parametrize("channel", list(CHANNELS))
def test_under_nccl_every_rank_aborts_the_group_before_its_error_propagates(from_step: int, backend: str,
                                                                            channel: str) -> None:
    results = run_on_ranks(
        lambda rank, world_size: _diverge_recording_aborts(from_step, world_size, backend == "nccl", channel), 2,
        timeout_s=60,
    )
    expected = [True] if backend == "nccl" else []
    assert results == [("ranks diverged under zero3", expected)] * 2


def _skip_the_last_block(rank: int, world_size: int) -> tuple[str, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _fit(1, world_size, steps=4, skipped=1)
            raised = ""
        except RankDivergenceError as err:
            raised = str(err).split(":")[0]
    return raised, [str(w.message).split(" parameter(s)")[0] for w in caught if "got no gradient" in str(w.message)]


def test_a_rank_that_skips_the_last_unit_is_refused_a_step_later() -> None:
    """The last block needs no collective of its own in a step that follows one where every rank ran it: the block
    before prefetches it on every rank, and backward gathers it on none (the ranks that run it keep it gathered from
    their forward). So in the step where one rank skips it first, the ranks' unit collectives pair up: that rank
    reduces zeros for its parameters and warns (DDP would raise). The next step's prefetch follows the order each rank
    ran last, which now differs, and every rank raises."""
    model = TinyLM()
    model.configure_model()
    in_last_block = len(list(model.lm["blocks"][-1].parameters()))
    assert run_on_ranks(_skip_the_last_block, 2, timeout_s=60) == [
        ("ranks diverged under zero3", []),
        ("ranks diverged under zero3", [f"rank 1: {in_last_block}"]),
    ]


class _BoardTimeout(pl.Callback):
    """The unit-order board's timeout, read during fit (the board closes at its end)."""

    timeout_s: float | None = None
    control_timeout_s: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        board = trainer.strategy.runtime.parameters._order
        self.timeout_s = board.timeout_s if isinstance(board, SharedBoard) else None
        control = trainer.strategy.runtime.comms._control._get_backend(torch.device("cpu"))
        self.control_timeout_s = control.options._timeout.total_seconds()


def _board_timeout(rank: int, world_size: int) -> float | None:
    seen = _BoardTimeout()
    trainer = make_trainer(ZeroStrategy(stage=3, units=("Block",), timeout=timedelta(seconds=42)), world_size,
                           max_steps=1, callbacks=[seen], limit_val_batches=0)
    trainer.fit(TinyLM())
    return seen.timeout_s, seen.control_timeout_s


def test_the_unit_order_board_waits_as_long_as_the_strategys_timeout() -> None:
    # The board takes the strategy's; the gloo control channel, a group lightning_zero makes, the default group's
    # (the harness made it with 120 s; under Lightning both are the strategy's), not torch's 30 minutes for new groups.
    assert run_on_ranks(_board_timeout, 2, timeout_s=60) == [(42.0, 120.0), (42.0, 120.0)]
