"""Stages 1 and 2: every rank keeps the full parameters; after an update each rank's new shards are all-gathered
into them, bucket by bucket (stage 3 replaces this with the units of param_hooks.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from lightning_zero.config import CommConfig
from lightning_zero.sharding.collectives import Collectives, InFlight
from lightning_zero.sharding.flat_param import Bucket, ParamShard, make_buckets


class ReplicatedParams:
    """Full parameters on every rank, rebuilt from the shards after each update."""

    def __init__(self, comms: Collectives, config: CommConfig) -> None:
        self.comms = comms
        self.config = config
        self._buckets: dict[tuple[ParamShard, ...], list[Bucket]] = {}

    @torch.no_grad()
    def gather(self, shards: Sequence[ParamShard]) -> None:
        """All-gather the local shards (cast to the parameters' dtype) of ``shards`` into their full parameters."""
        key = tuple(shards)
        if key not in self._buckets:
            self._buckets[key] = make_buckets(list(shards), self.config.bucket_bytes)
        in_flight = InFlight()
        for bucket in self._buckets[key]:
            in_flight.add(self.comms.all_gather(bucket), lambda full, b=bucket: _unpack(b, full))
        in_flight.drain()

    def after_update(self, stepped: Sequence[ParamShard]) -> None:
        """The shards an optimizer just stepped are gathered at once (their parameters are used in the next forward)."""
        self.gather(stepped)

    def begin_step(self) -> None:
        """Nothing to gather: the parameters are full."""

    def end_step(self) -> None:
        """Nothing to free."""

    @contextmanager
    def gathered(self) -> Iterator[None]:
        yield

    def remove(self) -> None:
        """No hooks to remove."""


def _unpack(bucket: Bucket, full: torch.Tensor) -> None:
    bucket.unpack(full, [s.param for s in bucket.shards])
    for shard in bucket.shards:
        shard.mark_written()
