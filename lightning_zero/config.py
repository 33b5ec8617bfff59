"""Configuration of the ZeRO strategy: small frozen dataclasses, validated on construction.

Every error names the field, the value it got and what is allowed, so that a bad value from the command line or from
Python fails before any process is launched.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_STAGES = (1, 2, 3)
#: Stages whose runtime exists in this release. A stage listed in SUPPORTED_STAGES but not here is refused with a
#: message that says so, rather than silently running a lower stage.
IMPLEMENTED_STAGES = (1, 2)


class ZeroConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the allowed values."""


@dataclass(frozen=True)
class ZeroConfig:
    """What to shard and how to communicate.

    Args:
        stage: 1 shards optimizer states; 2 also shards gradients (reduce-scattered during backward); 3 also shards
            parameters (gathered around each unit's forward and backward).
        bucket_mb: size in MiB of the flat buffers that gradients are packed into before each reduce-scatter, and
            that updated parameters are packed into before each all-gather. Bounds the transient memory of a step.
        broadcast_buffers: broadcast floating-point module buffers (e.g. BatchNorm running stats) from rank 0 before
            every training forward, as ``DistributedDataParallel`` does by default.
        find_unused_parameters: as in DDP: agree across ranks on which parameters got no gradient in a backward, so
            that a parameter no rank used keeps no gradient and is not stepped (one small extra all-reduce, and
            reduction starts only once backward ends). Without it such a parameter is stepped with a zero gradient.
    """

    stage: int = 2
    bucket_mb: float = 25.0
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in SUPPORTED_STAGES:
            raise ZeroConfigError(f"stage={self.stage!r} is invalid: allowed values are 1, 2 or 3")
        if self.stage not in IMPLEMENTED_STAGES:
            allowed = ", ".join(f"zero{s}" for s in IMPLEMENTED_STAGES)
            raise ZeroConfigError(
                f"stage={self.stage} (parameter partitioning) is not implemented in this release; "
                f"use one of: {allowed}"
            )
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)) or not self.bucket_mb > 0:
            raise ZeroConfigError(f"bucket_mb={self.bucket_mb!r} is invalid: it must be a number of MiB > 0")

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))
