"""The unit-order board (sharding/unit_order.py, [Note: the unit-order board]): two ranks' boards over one file, in
one process (the 2-rank fits that use it, and the gloo channel beside it, are in tests/distributed/test_divergence.py
and test_plain_step_work.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import DistNetworkError, default_pg_timeout

from lightning_zero.sharding import unit_order
from lightning_zero.sharding.unit_order import SLOTS, TAG_BITS, SharedBoard, pack, unpack, unit_order_channel


@pytest.fixture
def boards(tmp_path, monkeypatch):
    """Rank 0's and rank 1's board over one file, as ``SharedBoard.open`` leaves them (the file unlinked)."""
    monkeypatch.setattr(unit_order, "SHM_DIR", str(tmp_path))
    nbytes, number = 8 + 2 * SLOTS * 8, 12345
    path = unit_order._path(number)
    assert unit_order._create(path, nbytes, number)
    maps = [unit_order._map(path, nbytes, number) for _ in range(2)]
    assert unit_order._map(path, nbytes, number + 1) is None  # another board's number: not this one
    os.unlink(path)
    made = [SharedBoard(memory, rank, 2, timeout_s=0.5) for rank, memory in enumerate(maps)]
    yield made
    for board in made:
        board.close()


def test_a_word_holds_the_call_tag_and_the_three_values() -> None:
    word = pack(5 + (1 << TAG_BITS), [1, 70000, 123456])
    assert 0 < word < 1 << 63
    assert unpack(word) == (5, [1, 70000, 123456])
    assert unpack(pack(1, [0, 0, (1 << 24) + 3])) == (1, [0, 0, 3])  # the count modulo its range
    with pytest.raises(ValueError, match="17-bit field"):
        pack(1, [0, 1 << 17, 0])


def test_each_exchange_pairs_by_call_order_and_returns_every_ranks_values(boards) -> None:
    zero, one = boards
    posted = [zero.exchange_async([0, 3, 1]), zero.exchange_async([1, 3, 2])]  # rank 0 runs two ahead
    assert one.exchange([0, 3, 1]) == [[0, 3, 1], [0, 3, 1]]
    assert one.exchange([1, 4, 2]) == [[1, 3, 2], [1, 4, 2]]  # a disagreement is seen, not hidden
    assert [p.wait() for p in posted] == [[[0, 3, 1], [0, 3, 1]], [[1, 3, 2], [1, 4, 2]]]
    for call in range(3, 3 + 2 * SLOTS):  # the rows wrap around: each call still reads its own
        zero.exchange_async([0, call % 100, 1])
        assert one.exchange([0, call % 100, 1]) == [[0, call % 100, 1]] * 2


def test_a_read_waits_for_the_other_rank(boards) -> None:
    zero, one = boards
    late = threading.Timer(0.05, lambda: one.exchange_async([0, 9, 1]))
    late.start()
    started = time.perf_counter()
    assert zero.exchange([0, 9, 1]) == [[0, 9, 1], [0, 9, 1]]
    assert time.perf_counter() - started >= 0.04
    late.join()


def test_a_rank_that_never_announces_times_out_naming_it(boards) -> None:
    zero, _ = boards
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not announce unit collective 1 within 0.5 s"):
        zero.exchange([0, 1, 1])


def test_a_row_overrun_by_a_rank_too_far_ahead_raises(boards) -> None:
    zero, one = boards
    for _ in range(SLOTS + 1):
        one.exchange_async([0, 1, 1])
    with pytest.raises(RuntimeError, match="ahead of rank 0 on the unit-order board"):
        zero.exchange([0, 1, 1])


class _TwoRanks:
    """Rank 0 of a 2-rank group whose other rank answers ``peer_ok`` when asked whether it mapped the board."""

    rank, world_size, local = 0, 2, False

    def __init__(self, peer_ok: int) -> None:
        self.peer_ok = peer_ok

    def exchange(self, values):
        if len(values) == 1:  # the board's number: rank 0's
            return [list(values), [0]]
        ok, _, namespace = values
        return [list(values), [self.peer_ok, 1, namespace]]

    def open_control_channel(self) -> None:
        pass


@pytest.mark.parametrize("peer_ok", [1, 0], ids=["every-rank-mapped", "a-rank-elsewhere"])
def test_opening_uses_the_board_only_if_every_rank_mapped_it_and_leaves_no_file(tmp_path, monkeypatch, peer_ok) -> None:
    monkeypatch.setattr(unit_order, "SHM_DIR", str(tmp_path))
    board = SharedBoard.open(_TwoRanks(peer_ok), timeout_s=60.0)
    assert (board is not None) == bool(peer_ok)
    assert list(tmp_path.iterdir()) == []
    if board is not None:
        assert board.pids == [os.getpid(), 1]  # one namespace of process ids: liveness is checked
        board.close()


def test_a_rank_whose_process_ended_is_named_while_waiting(boards) -> None:
    # A killed peer closes nothing the board sees: the waiting rank looks at the processes it waits for.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    zero, _ = boards
    zero.pids = [os.getpid(), gone.pid]
    started = time.perf_counter()
    with pytest.raises(DistNetworkError, match=rf"rank 1 \(process {gone.pid} on this host\) ended before it "
                                               "announced unit collective 1"):
        zero.exchange([0, 1, 1])
    assert time.perf_counter() - started < 0.4  # within a few LIVENESS_S, not the timeout


def test_the_board_waits_as_long_as_the_strategys_timeout_then_gives_up(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(unit_order, "SHM_DIR", str(tmp_path))
    default = unit_order_channel(_TwoRanks(1), 4, timeout=None)
    assert default.timeout_s == default_pg_timeout.total_seconds()  # torch's default, as init_process_group's
    default.close()
    board = unit_order_channel(_TwoRanks(1), 4, timeout=timedelta(seconds=0.3))
    assert isinstance(board, SharedBoard) and board.timeout_s == 0.3
    started = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not announce unit collective 1 within 0.3 s"):
        board.exchange([0, 1, 1])  # the peer's row is never written
    assert 0.3 <= time.perf_counter() - started < 5
    board.close()
