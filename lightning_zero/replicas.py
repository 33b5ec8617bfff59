"""A cheap check that the state every rank should hold identically is identical: the full parameters (under stage 3,
as gathered) and the floating-point buffers. Each rank hashes its tensors (CRC-32 of their bytes, on the host) and
the ranks exchange the digests: one small all-gather of integers, never the tensors themselves. Replicas that differ
mean the ranks diverged (a non-deterministic kernel, an edit made on one rank only, a skipped step on one rank), and
would silently train different models under data parallelism."""

from __future__ import annotations

import zlib

import torch
from torch import Tensor, nn

from lightning_zero.sharding.collectives import Collectives


class ReplicaMismatchError(RuntimeError):
    """Tensors that every rank should hold identically differ between ranks; the message names them."""


def replicated_tensors(module: nn.Module) -> dict[str, Tensor]:
    """The parameters and floating-point buffers of ``module``, by name (tied tensors once)."""
    tensors = dict(module.named_parameters())
    tensors.update((name, b) for name, b in module.named_buffers() if b.is_floating_point())
    return tensors


def digest(tensor: Tensor) -> int:
    """CRC-32 of the tensor's bytes (its values and dtype; not its device or strides)."""
    data = tensor.detach().to("cpu", copy=False).contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(data.numpy().tobytes(), zlib.crc32(str(tensor.dtype).encode()))


def check_replicas(module: nn.Module, comms: Collectives) -> int:
    """Raise :class:`ReplicaMismatchError` on every rank if any rank's replicated tensors differ from rank 0's,
    naming the tensors and the ranks; return how many tensors were compared. Every rank must call it."""
    tensors = replicated_tensors(module)
    # The counts first: the digests' all-gather needs the same number of values from every rank.
    counts = [count for (count,) in comms.exchange([len(tensors)])]
    if len(set(counts)) > 1:
        raise ReplicaMismatchError(f"ranks hold different numbers of replicated tensors: {counts} (by rank)")
    everyone = comms.exchange([digest(t) for t in tensors.values()])
    names = list(tensors)
    differing = {
        name: [rank for rank, values in enumerate(everyone) if values[i] != everyone[0][i]]
        for i, name in enumerate(names)
    }
    differing = {name: ranks for name, ranks in differing.items() if ranks}
    if differing:
        listed = "; ".join(f"{name} (rank(s) {ranks} differ from rank 0)" for name, ranks in list(differing.items())[:8])
        more = f" and {len(differing) - 8} more" if len(differing) > 8 else ""
        raise ReplicaMismatchError(f"{len(differing)} replicated tensor(s) differ between ranks: {listed}{more}")
    return len(names)
