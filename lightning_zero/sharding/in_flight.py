"""What a collective hands back while it runs, and the memory bucket collectives run in: the handles ``Issued``
returns (``Gathered``, ``QuantizedGathered``, ``Reduced``, ``QuantizedReduced``, ``Exchanged``), each completed by its
``wait()``; ``InFlight``, the one queue that completes launched bucket collectives in order while bounding how many
that hold memory are pending; ``Relays``, the thread that issues the second stage of a two-stage collective as soon as
its first completes; and ``BufferPool``, the bucket buffers kept between collectives. Nothing here issues a
collective: collectives.py does, and makes these.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_zero.sharding.buckets import Bucket
from lightning_zero.sharding.quantize import BlockFormat, PayloadLayout, TwoStageReduce, dequantize

if TYPE_CHECKING:
    from lightning_zero.sharding.collectives import Collectives

#: Bucket collectives (gradient reduce-scatters, parameter all-gathers) in flight at once: bounds the transient memory
#: of full-size bucket buffers to this many while still overlapping one with the packing of the next.
MAX_IN_FLIGHT = 2


@dataclass(eq=False, kw_only=True)
class Issued:
    """A collective in flight: its async works, and ``guard``, given when it is issued, which runs once before it is
    waited on (a check that may raise instead of waiting on a mismatched collective: see [Note: ranks that run
    different units] in param_hooks.py)."""

    works: list = field(default_factory=list)
    guard: Callable[[], None] | None = None

    #: Memory the collective itself holds until it completes, besides the caller's tensors.
    held_bytes: int = 0

    def _complete(self) -> None:
        if self.guard is not None:
            guard, self.guard = self.guard, None
            guard()
        works, self.works = self.works, []
        for work in works:
            work.wait()


@dataclass(eq=False, kw_only=True)
class Gathered(Issued):
    """An all-gather in flight; ``wait()`` gives the full rank-major buffer."""

    buffer: Tensor

    def wait(self) -> Tensor:
        self._complete()
        return self.buffer


class NonFiniteWeightsError(RuntimeError):
    """A shard handed to a quantized all-gather held an inf or a NaN (see [Note: the quantized all-gather])."""


class WeightCheck:
    """The non-finite flags of a step's quantized all-gathers, each a device tensor per parameter of a bucket, read
    together once, at the end of the step (``raise_if_nonfinite``): reading each gather's flags where it completes
    would make the host wait for every gather on CUDA (see [Note: the quantized all-gather])."""

    def __init__(self) -> None:
        self._checked: list[tuple[Tensor, Bucket]] = []

    def record(self, flags: Tensor, bucket: Bucket) -> None:
        """``flags``: one per parameter of ``bucket``, in its order."""
        self._checked.append((flags, bucket))

    def raise_if_nonfinite(self) -> None:
        """Raise ``NonFiniteWeightsError`` naming the first parameter whose gathered blocks held an inf or a NaN since
        the last call (one host synchronisation; none when nothing was gathered quantized)."""
        if not self._checked:
            return
        checked, self._checked = self._checked, []
        flags = torch.cat([flags for flags, _ in checked])
        if bool(flags.any()):
            names = [shard.name for _, bucket in checked for shard in bucket.shards]
            raise NonFiniteWeightsError(
                f"quantize_weights=True: the shards of {names[flags.tolist().index(True)]} hold an inf or a NaN, which "
                "int8 blocks cannot carry; every rank stops here. Find where the weights became non-finite "
                "(nonfinite_grads='raise' stops at the gradient that would make them so), or train without "
                "quantize_weights"
            )


@dataclass(eq=False, kw_only=True)
class QuantizedGathered(Gathered):
    """A quantized all-gather in flight: ``payloads`` ``(n, nbytes)`` receives every rank's payload, made of one
    piece per parameter of ``bucket`` (``pieces``); ``wait()`` dequantizes them into ``buffer`` and gives it, and
    records in ``check`` which parameters had a block of any rank with an inf or a NaN (its scale is NaN, and so
    is every element of the block once dequantized)."""

    payloads: Tensor
    bucket: Bucket
    pieces: list[PayloadPiece]
    check: WeightCheck

    def wait(self) -> Tensor:
        self._complete()
        n = self.payloads.shape[0]
        received = [piece.of(self.payloads) for piece in self.pieces]
        nonfinite = torch.stack([piece.layout.scales(p).isnan().any() for piece, p in zip(self.pieces, received)])
        self.check.record(nonfinite, self.bucket)
        table = self.buffer.view(n, -1)
        for piece, payload in zip(self.pieces, received):
            values = table[:, piece.start : piece.start + piece.layout.numel]
            dequantize(payload, piece.layout.fmt, piece.layout.numel, out=values)
        return self.buffer


@dataclass(frozen=True)
class PayloadPiece:
    """One parameter's part of a quantized segment: its ``layout.numel`` elements from element ``start`` of the
    segment, quantized into the payload's bytes from ``offset`` (see [Note: the quantized all-gather])."""

    start: int
    offset: int
    layout: PayloadLayout

    def of(self, payload: Tensor) -> Tensor:
        return payload[..., self.offset : self.offset + self.layout.nbytes]


def payload_pieces(bucket: Bucket, fmt: BlockFormat) -> list[PayloadPiece]:
    """The pieces of a quantized segment of ``bucket``, one per parameter, laid end to end (each payload a multiple
    of 4 bytes, so every piece's scales stay aligned)."""
    pieces, start, offset = [], 0, 0
    for numel in bucket.padded_numels:
        pieces.append(PayloadPiece(start, offset, fmt.layout(numel)))
        start, offset = start + numel, offset + pieces[-1].layout.nbytes
    return pieces


@dataclass(eq=False, kw_only=True)
class Reduced(Issued):
    """A reduce-scatter in flight; ``wait()`` gives this rank's averaged rows, one view per parameter of ``bucket``:
    ``segment`` itself, once the other ranks' copies of it that the exchange ``received`` (off NCCL) are added in
    rank order, and, under hybrid sharding, summed across ``replicas`` (see [Note: hybrid sharding's
    collectives])."""

    bucket: Bucket
    segment: Tensor
    received: Tensor | None = None
    replicas: Collectives | None = None

    def wait(self) -> list[Tensor]:
        self._complete()
        if self.received is not None:
            received, self.received = self.received, None
            for row in received:
                self.segment.add_(row)
        if self.replicas is not None:
            replicas, self.replicas = self.replicas, None
            replicas.all_reduce_(self.segment, f"the gradient shard of {self.bucket.shards[0].name}")
        return self.bucket.local_views(self.segment)


@dataclass(eq=False, kw_only=True)
class QuantizedReduced(Reduced):
    """A quantized reduce-scatter (qgZ) between its two all-to-alls: ``received`` ``(K, G, P)`` gets the payloads of
    the node's members; ``wait()`` sums them, exchanges the partial sums across nodes through ``comms``, writes the
    sum into ``segment`` (the bucket's dtype) and gives its rows (see [Note: the quantized reduce-scatter])."""

    plan: TwoStageReduce
    comms: Collectives

    def wait(self) -> list[Tensor]:
        self._complete()
        if self.received is not None:
            received, self.received = self.received, None
            self.segment.copy_(self.comms._reduce_across_nodes(self.plan, self.plan.reduce_intra(received)))
        return self.bucket.local_views(self.segment)


@dataclass(eq=False, kw_only=True)
class Exchanged(Issued):
    """Control values in flight between ranks; ``wait()`` gives every rank's, in rank order."""

    tensors: list[Tensor]

    def wait(self) -> list[list[int]]:
        self._complete()
        return [t.tolist() for t in self.tensors]


@dataclass(eq=False)
class Relayed:
    """The second stage of a two-stage collective, waited as a work is: once ``Relays`` has waited for the first stage
    and issued the second (``works``), the second's works; an error of either is raised here."""

    works: list = field(default_factory=list)
    error: BaseException | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def wait(self) -> None:
        while not self.ready.wait(0.5):  # in slices: the watchdog's error can still reach a thread waiting here
            pass
        if self.error is not None:
            raise self.error
        for work in self.works:
            work.wait()


class Relays:
    """Second stages of two-stage collectives (by_node.py, [Note: hierarchical collectives]), issued as soon as
    their first stage completes instead of when the caller waits, so that the link between nodes does not stand idle
    until then: a daemon thread takes them in the order given, waits for each first stage's works and runs its
    ``then``, which issues the second stage (point-to-point operations, whose tags the caller fixed when it issued the
    first, so the order in which threads issue them does not matter) and returns its works. Started by the first
    relay, ended by ``close``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def after(self, works: list, then: Callable[[], list]) -> Relayed:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        relayed = Relayed()
        self._queue.put((works, then, relayed))
        return relayed

    def close(self) -> None:
        """End the thread once the relays queued have run (nothing is left after a step)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10.0)
            self._thread = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            works, then, relayed = item
            try:
                for work in works:
                    work.wait()
                relayed.works = then()
            except BaseException as err:  # a peer's failure: raised where the caller waits
                relayed.error = err
            relayed.ready.set()


class InFlight:
    """Collectives launched bucket by bucket and completed in launch order, bounding the transient memory they hold
    (a bucket buffer, a full gradient freed on completion, the segments a reduce-scatter receives): the oldest is
    completed while more than ``limit`` of those holding memory are pending. One running on a tensor in place and
    receiving nothing holds no extra memory, so does not count.

    A completed collective is consumed only here: gloo's point-to-point works report completion only once waited on,
    so pending reductions keep what they received until they are pushed out. A cap on pending bytes instead of on
    pending holders (up to two buckets' bytes) let many in-place reductions pile up their received segments late in
    the backward: 20 MB of zero1's training peak at L-2, with no step time gained (BENCHMARKS.md findings)."""

    def __init__(self, limit: int = MAX_IN_FLIGHT) -> None:
        self.limit = limit
        self._queue: deque[tuple[Reduced | Gathered, Callable[[Any], None], bool]] = deque()
        self._holding = 0

    def add(self, issued: Reduced | Gathered, on_done: Callable[[Any], None], held_bytes: int) -> None:
        """Queue ``issued``, which holds ``held_bytes`` of transient memory until ``on_done`` has consumed it."""
        holds = held_bytes > 0
        self._queue.append((issued, on_done, holds))
        self._holding += holds
        while self._holding > self.limit:
            self._complete_oldest()

    def drain(self) -> None:
        while self._queue:
            self._complete_oldest()

    def __len__(self) -> int:
        return len(self._queue)

    def _complete_oldest(self) -> None:
        issued, on_done, holds = self._queue.popleft()
        self._holding -= holds
        on_done(issued.wait())


class BufferPool:
    """Bucket buffers kept between collectives: a collective takes one of at least the size it needs and gives it
    back once its result is consumed, so the next one allocates nothing.

    [Note: what the buffer pools keep, and where]
    A pool pays only on a host, where every buffer freed and allocated again costs page faults (measured in
    BENCHMARKS.md); on CUDA the caching allocator already reuses freed blocks, so a pool there keeps nothing. Free
    buffers are kept while there are at most ``limit`` of them per dtype and, with ``max_bytes``, while they hold at
    most that many bytes in all; a buffer that would pass either bound goes back to the allocator. Stages 1 and 2
    keep one per reduction that may be pending (``MAX_IN_FLIGHT``) from the backward's reductions to the gathers
    after the update, and ``clear`` them once those complete, so that the next forward's activations can use that
    memory (see [Note: the parameter all-gather overlaps the next forward]). Stage 3 keeps them across units,
    bounded by ``buffer_pool_mb`` (default: twice the largest unit's buffer; the root unit, gathered once a step, is
    not counted, so a large tied embedding is not kept twice), ``model_state_bytes`` counts what it keeps
    (``buffers``), and in a lean run (memory_policy.py) ``clear``s them at the end of each step (after its last
    backward, before the update): kept from step to step, two units' buffers were 0.22 of ZeRO-3's 16Ψ/N on a GPT-2
    of 4 layers (a unit is a fifth of it). Stages 1 and 2 likewise hand theirs back only in a lean run. Allocating
    them again costs CPU time where a step is short: 1.10x (1.03-1.14x over six rounds) on that GPT-2's 0.2 s step,
    none measurable on the 10.6M GPT of M-2 (0.99x); a ``buffer_pool_mb`` given keeps that many MiB from step to step
    (BENCHMARKS.md, "What a rank holds after a step").
    """

    def __init__(self, device: torch.device, limit: int = MAX_IN_FLIGHT, max_bytes: int | None = None) -> None:
        self.device = device
        pays = device.type != "cuda"
        self.limit = limit if pays else 0
        self.max_bytes = max_bytes
        self._free: dict[torch.dtype, list[Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        """The smallest free buffer of at least ``numel`` elements (so that a large one stays for the large bucket
        that needs it), or a new one, replacing the smallest free buffer if every one is too small."""
        free = self._free.setdefault(dtype, [])
        by_size = sorted(range(len(free)), key=lambda i: free[i].numel())
        for i in by_size:
            if free[i].numel() >= numel:
                return free.pop(i)[:numel]
        if free:
            free.pop(by_size[0])  # every one is too small: the smallest is replaced by one that fits
        return torch.empty(numel, dtype=dtype, device=self.device)

    def give(self, buffer: Tensor) -> None:
        """Return a buffer from ``take`` (its whole storage is reused), unless keeping it would pass a bound."""
        whole = torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(buffer.untyped_storage())
        free = self._free.setdefault(buffer.dtype, [])
        fits = self.max_bytes is None or self.nbytes() + whole.untyped_storage().nbytes() <= self.max_bytes
        if len(free) < self.limit and fits:
            free.append(whole)

    def clear(self) -> None:
        """Hand the free buffers back to the allocator (the buffers taken stay with their collectives)."""
        self._free.clear()

    def buffers(self) -> list[Tensor]:
        return [b for free in self._free.values() for b in free]

    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self.buffers())


@dataclass(eq=False)
class BucketGather:
    """One bucket's all-gather into a buffer of its own or one from ``pool`` (``pooled``); ``complete(unpack)`` waits,
    hands the full buffer to ``unpack``, then gives the pool's buffer back (nothing refers to it any more)."""

    gathered: Gathered
    pool: BufferPool
    pooled: Tensor | None

    def complete(self, unpack: Callable[[Tensor], Any]) -> Any:
        result = unpack(self.gathered.wait())
        if self.pooled is not None:
            self.pool.give(self.pooled)
            self.pooled = None
        return result


def gather_bucket(
    comms: Collectives, pool: BufferPool, bucket: Bucket, sources: Sequence[Tensor] | None = None,
    into: Tensor | None = None, guard: Callable[[], None] | None = None, fmt: BlockFormat | None = None,
) -> BucketGather:
    """Issue ``bucket``'s all-gather (of ``sources``, default each shard's ``gather_source``; quantized in ``fmt``
    if given) into ``into`` (a tensor that already is the bucket's rank-major buffer: a parameter gathered in place)
    or a buffer from ``pool``; the one way stages 1-3 and the end of fit gather a bucket."""
    buffer = into if into is not None else pool.take(bucket.full_numel, bucket.dtype)
    gathered = comms.all_gather(bucket, sources, buffer=buffer, guard=guard, fmt=fmt)
    return BucketGather(gathered, pool, None if into is not None else buffer)
