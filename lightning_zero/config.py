"""Configuration of the ZeRO strategy: small frozen dataclasses, validated on construction.

Every error names the field, the value it got and what is allowed, so that a bad value from the command line or from
Python fails before any process is launched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_STAGES = (1, 2, 3)
_REDUCE_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
        prefetch: stage 3: how many units ahead of the one computing have their all-gather issued early; at most
            ``prefetch + 1`` gathered units are alive at once (plus, in backward, units whose gradients are pending).
        reshard_after_forward: stage 3: free a unit's parameters after its forward and gather them again for backward
            (ZeRO-3); ``False`` keeps them from forward to backward, trading memory for one all-gather less.
        units: stage 3: which submodules are gathered together, by class name, qualified class name or module path
            (wildcards allowed), e.g. ``("Block",)``; empty selects units by size (``unit_mb``).
        unit_mb: stage 3 with ``units`` empty: a submodule becomes a unit once its parameters not yet in a smaller
            unit reach this many MiB.
        reduce_dtype: dtype gradients are reduced and their shards kept in: ``None`` (default) uses the working
            dtype (fp32, or bf16/fp16 under mixed precision), as the ZeRO paper's memory figures and DeepSpeed and
            FSDP2 do, halving gradient traffic; ``"fp32"`` sums 16-bit gradients in fp32 for accuracy at twice the
            traffic and gradient-shard memory.
        find_unused_parameters: as in DDP: agree across ranks on which parameters got no gradient in a backward, so
            that a parameter no rank used keeps no gradient and is not stepped (one small extra all-reduce, and
            reduction starts only once backward ends). Without it such a parameter is stepped with a zero gradient.
    """

    stage: int = 2
    bucket_mb: float = 25.0
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    prefetch: int = 1
    reshard_after_forward: bool = True
    units: tuple[str, ...] = ()
    unit_mb: float = 16.0
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in SUPPORTED_STAGES:
            raise ZeroConfigError(f"stage={self.stage!r} is invalid: allowed values are 1, 2 or 3")
        for name in ("bucket_mb", "unit_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ZeroConfigError(f"{name}={value!r} is invalid: it must be a number of MiB > 0")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ZeroConfigError(f"prefetch={self.prefetch!r} is invalid: it must be an integer >= 1")
        if isinstance(self.units, str) or not all(isinstance(u, str) and u for u in self.units):
            raise ZeroConfigError(
                f"units={self.units!r} is invalid: it must be a list of module class names or module paths"
            )
        if self.reduce_dtype not in _REDUCE_DTYPES:
            allowed = ", ".join(repr(k) for k in _REDUCE_DTYPES)
            raise ZeroConfigError(f"reduce_dtype={self.reduce_dtype!r} is invalid: allowed values are {allowed}")
        for name in ("broadcast_buffers", "find_unused_parameters", "reshard_after_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ZeroConfigError(f"{name}={getattr(self, name)!r} is invalid: it must be true or false")

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))

    @property
    def reduce_torch_dtype(self) -> torch.dtype | None:
        return _REDUCE_DTYPES[self.reduce_dtype]

    @property
    def unit_bytes(self) -> int:
        return max(1, int(self.unit_mb * 2**20))
