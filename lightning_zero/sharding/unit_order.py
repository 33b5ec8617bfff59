"""Where zero3's ranks tell one another which unit collective they are about to issue (see [Note: ranks that run
different units] in param_hooks.py): a board in shared memory when every rank of the group runs on this host, else
the group's gloo control channel (``Collectives.exchange``).

[Note: the unit-order board]
The check swaps three integers per unit collective, some 25 times a step. Over gloo each swap is an all-gather: a
Python call into c10d, a hand-over to gloo's worker thread and back, a message each way; measured on 2 CPU ranks (a
10.6M-parameter GPT, the M-2 benchmark), 9% of a zero3 step's CPU time and 11% of its wall time. Ranks on one host
can instead write to and read from one memory: a file in ``/dev/shm`` that every rank of the group maps, one row of
``SLOTS`` 64-bit words per rank. A rank's ``c``-th announcement goes into word ``c % SLOTS`` of its row, as one
aligned 64-bit store (which no reader sees half-written, on x86-64 and ARM64 alike): ``c`` modulo ``2**TAG_BITS`` in
the high bits, then the kind, the unit and the count of the step. Reading the ``c``-th exchange is reading word
``c % SLOTS`` of every row until each holds tag ``c``: the same pairing by call order an all-gather makes, so the
check reasons about it unchanged. A rank cannot get ``SLOTS`` announcements ahead of another: it waits on the gathers
it issues, which need the other's; a word found more than half the tag range ahead says the rows were overrun, and
raises.

A rank waits only where another has not announced yet. It sleeps, in steps growing from 20 microseconds to a
millisecond, at once rather than spinning first: on 2 busy cores a rank that spun (64 ``sched_yield`` calls before the
first sleep) took the core from its own gloo thread, whose transfer it was waiting for (M-2, 6 rounds: 385 ms a step
spinning, 341 sleeping at once, 377 with the check off). It runs Python throughout, so the watchdog's error reaches
it, and it gives up after the timeout the collective it stands for would have (``ZeroStrategy(timeout=...)``, the
process group's), naming the ranks that never announced. A peer that
died (killed, out of memory) closes no connection the board would see, where gloo's collective would have failed at
once ("Connection reset by peer", which the watchdog turns into an error naming the rank within a probe): so every
``LIVENESS_S`` of waiting the board looks whether the processes it waits for still run (``/proc/PID``, the ranks'
process ids swapped at opening, checked only where every rank sees the same process-id namespace), and raises a
``DistNetworkError`` naming the rank that ended, which the watchdog treats as gloo's error.

Opening is collective over the control channel: group rank 0 creates the file under a random name and writes that
name's number in the file's first word, every rank maps it and checks the number, and the board is used only if every
rank could (ranks on other hosts, or in containers that do not share ``/dev/shm``, cannot); rank 0 then unlinks the
file, so nothing is left behind once the ranks exit, however they exit."""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed import DistNetworkError, default_pg_timeout

from lightning_zero.sharding.collectives import Collectives

#: Announcements kept per rank: far more than a rank can be ahead of another (see the Note).
SLOTS = 1024
#: Bits of each word: the call's tag, the kind, the unit, the count of the step (63 in all: the word stays positive).
TAG_BITS, KIND_BITS, UNIT_BITS, COUNT_BITS = 20, 2, 17, 24
#: Units a board can name; a model with more checks over the control channel.
MAX_UNITS = 1 << UNIT_BITS
#: A step's unit collectives are counted modulo this (by the gloo channel's callers too, so both compare alike).
COUNT_RANGE = 1 << COUNT_BITS
#: Where the board's file is made.
SHM_DIR = "/dev/shm"
#: How often a waiting rank looks whether the ranks it waits for still run.
LIVENESS_S = 0.05


def unit_order_channel(comms: Collectives, units: int, timeout: timedelta | None) -> SharedBoard | Collectives:
    """What zero3's unit-order check exchanges through: a :class:`SharedBoard` where every rank of ``comms``' group
    shares this host's memory (and there are at most ``MAX_UNITS`` units), else ``comms``' control channel. A board
    waits at most ``timeout``, the process group's (``None``: torch's default, as for ``init_process_group``). Every
    rank of the group calls it, at the same point."""
    comms.open_control_channel()
    if units > MAX_UNITS and not comms.local:
        _report_too_many_units(units)
    timeout_s = (timeout if timeout is not None else default_pg_timeout).total_seconds()
    board = SharedBoard.open(comms, timeout_s) if units <= MAX_UNITS and not comms.local else None
    return board if board is not None else comms


def _report_too_many_units(units: int) -> None:
    """A model whose units a board's word cannot name checks over the control channel: said once, on rank 0."""
    rank_zero_warn(
        f"zero3: the model has {units} units, more than the {MAX_UNITS} the unit-order board names, so the unit-order "
        "check (verify_unit_order) exchanges over the gloo control channel instead of shared memory: one all-gather "
        "per unit collective (about 9% of a step's CPU time and 11% of its wall time at M-2); fewer, larger units "
        "(units=, unit_mb=) keep the board, verify_unit_order=False drops the check"
    )


def pack(call: int, values: Sequence[int]) -> int:
    """One word: ``call``'s tag, then ``values`` = (kind, unit, count of the step), the count modulo its range."""
    kind, unit, count = values
    word = call % (1 << TAG_BITS)
    for value, bits in ((kind, KIND_BITS), (unit, UNIT_BITS), (count % COUNT_RANGE, COUNT_BITS)):
        if not 0 <= value < 1 << bits:
            raise ValueError(f"{value} does not fit the unit-order board's {bits}-bit field")
        word = word << bits | value
    return word


def unpack(word: int) -> tuple[int, list[int]]:
    """``(tag, [kind, unit, count])`` of a word ``pack`` made."""
    values = []
    for bits in (COUNT_BITS, UNIT_BITS, KIND_BITS):
        values.append(word & ((1 << bits) - 1))
        word >>= bits
    return word, values[::-1]


class SharedBoard:
    """Every rank's unit-collective announcements, in memory the ranks of one host share (see [Note: the unit-order
    board]). ``exchange`` and ``exchange_async`` answer as ``Collectives``' do."""

    #: Announcements made on every board of this process: part of how far a rank is (see [Note: a read that runs on
    #: one rank] in joined_reads.py; a board's exchanges are not collectives, which c10d counts).
    announced_in_process = 0

    def __init__(self, memory: mmap.mmap, rank: int, world_size: int, timeout_s: float,
                 pids: Sequence[int] | None = None) -> None:
        self._memory = memory
        #: Each rank's process id, where they all share this process's namespace of them (else ``None``).
        self.pids = list(pids) if pids is not None else None
        #: The rows, rank-major: word ``slot`` of rank ``r``'s row is ``_words[r * SLOTS + slot]``.
        self._words = memoryview(memory)[8 : 8 + world_size * SLOTS * 8].cast("q")
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._calls = 0

    @classmethod
    def open(cls, comms: Collectives, timeout_s: float) -> SharedBoard | None:
        """The board of ``comms``' group, whose reads wait at most ``timeout_s``, or ``None`` where some rank cannot
        map it (collective: see the Note)."""
        nbytes = 8 + comms.world_size * SLOTS * 8
        number = 0
        if comms.rank == 0:
            number = secrets.randbits(62) or 1
            if not _create(_path(number), nbytes, number):
                number = 0
        (number,) = comms.exchange([number])[0]
        memory = _map(_path(number), nbytes, number) if number else None
        everyone = comms.exchange([int(memory is not None), os.getpid(), _pid_namespace()])
        if comms.rank == 0 and number:
            os.unlink(_path(number))  # every rank that could has mapped it
        if not all(ok for ok, _, _ in everyone):
            if memory is not None:
                memory.close()
            return None
        same = len({ns for _, _, ns in everyone}) == 1 and everyone[0][2] != 0
        pids = [pid for _, pid, _ in everyone] if same else None
        return cls(memory, comms.rank, comms.world_size, timeout_s, pids)

    def exchange_async(self, values: Sequence[int]) -> Posted:
        """Announce ``values`` (kind, unit, count of the step) as this rank's next exchange."""
        self._calls += 1
        SharedBoard.announced_in_process += 1
        self._words[self.rank * SLOTS + self._calls % SLOTS] = pack(self._calls, values)
        return Posted(self, self._calls)

    def exchange(self, values: Sequence[int]) -> list[list[int]]:
        return self.exchange_async(values).wait()

    def read(self, call: int) -> list[list[int]]:
        """Every rank's values of exchange ``call``, in rank order, once every rank has announced it."""
        slot, tag, half = call % SLOTS, call % (1 << TAG_BITS), 1 << (TAG_BITS - 1)
        rows: list[list[int] | None] = [None] * self.world_size
        pause, deadline, looked = 20e-6, None, None  # the clock is read only once a read has to wait
        while True:
            for r in range(self.world_size):
                if rows[r] is None:
                    theirs, values = unpack(self._words[r * SLOTS + slot])
                    if theirs == tag:
                        rows[r] = values
                    elif 0 < (theirs - tag) % (1 << TAG_BITS) < half:
                        raise RuntimeError(f"rank {r} is {SLOTS} or more unit collectives ahead of rank {self.rank} "
                                           "on the unit-order board: the ranks no longer run the same units")
            if all(row is not None for row in rows):
                return rows
            now = time.monotonic()
            if deadline is None:
                deadline, looked = now + self.timeout_s, now
            elif now > deadline:
                missing = [r for r, row in enumerate(rows) if row is None]
                raise TimeoutError(f"ranks {missing} did not announce unit collective {call} within "
                                   f"{self.timeout_s:g} s (ZeroStrategy's timeout)")
            if self.pids is not None and now - looked > LIVENESS_S:
                looked = now
                for r, row in enumerate(rows):
                    if row is None and _ended(self.pids[r]):
                        raise DistNetworkError(f"rank {r} (process {self.pids[r]} on this host) ended before it "
                                               f"announced unit collective {call}: it exited or was killed")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def close(self) -> None:
        self._words.release()
        self._memory.close()


@dataclass(eq=False)
class Posted:
    """An announcement on a :class:`SharedBoard`; ``wait()`` gives every rank's values, as ``Exchanged`` does."""

    board: SharedBoard
    call: int

    def wait(self) -> list[list[int]]:
        return self.board.read(self.call)


def _path(number: int) -> str:
    return os.path.join(SHM_DIR, f"lightning_zero-unit-order-{number:016x}")


def _create(path: str, nbytes: int, number: int) -> bool:
    """Make the board's file, zeroed, ``number`` in its first word; whether that worked."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return False
    try:
        os.ftruncate(fd, nbytes)
        os.pwrite(fd, int(number).to_bytes(8, "little"), 0)
        return True
    except OSError:
        os.unlink(path)
        return False
    finally:
        os.close(fd)


def _map(path: str, nbytes: int, number: int) -> mmap.mmap | None:
    """The board's file mapped, if it is there with ``number`` in its first word."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != nbytes:
            return None
        memory = mmap.mmap(fd, nbytes)
    except OSError:
        return None
    finally:
        os.close(fd)
    if int.from_bytes(memory[:8], "little") != number:
        memory.close()
        return None
    return memory


def _pid_namespace() -> int:
    """This process's process-id namespace (the inode of ``/proc/self/ns/pid``), 0 where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _ended(pid: int) -> bool:
    """Whether process ``pid`` of this namespace is gone or a zombie (killed, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state in (b"Z", b"X")
