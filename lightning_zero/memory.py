"""Counting the model-state bytes a rank holds, from the tensors themselves.

Parameters, gradients and optimizer states are counted by storage, so a tensor and the views of it (a stage-1/2 shard
is a view of its full parameter) are counted once, at the size of the storage actually allocated.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of one rank's model states by kind (wherever they live), how many of them live on the host and on disk
    rather than on the training device, and the buffers kept between uses to move them (bucket pools, offload's
    staging and I/O buffers), which are not model state but are held all the same (``buffers``, of which
    ``buffers_host`` on the host)."""

    params: int
    grads: int
    optimizer: int
    host: int = 0
    disk: int = 0
    buffers: int = 0
    buffers_host: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> int:
        """Bytes on the training device (the CPU itself in a CPU run, where placement is still accounted)."""
        return self.total - self.host - self.disk

    @property
    def held(self) -> int:
        """Everything counted: the model states and the kept buffers."""
        return self.total + self.buffers


def model_state_bytes(
    module: nn.Module,
    optimizers: Iterable[Optimizer] = (),
    extra_params: Iterable[torch.Tensor] = (),
    extra_grads: Iterable[torch.Tensor] = (),
    extra_optimizer: Iterable[torch.Tensor] = (),
    host: Iterable[torch.Tensor] = (),
    disk: Iterable[torch.Tensor] = (),
    buffers: Iterable[torch.Tensor] = (),
    host_buffers: Iterable[torch.Tensor] = (),
) -> ModelStateBytes:
    """Bytes of the parameters of ``module``, their gradients and the ``optimizers``' states.

    The ``extra_*`` tensors are model state held outside the module and the optimizers' ``state`` (a sharding
    strategy's standalone parameter shards, gradient shard storage, fp32 master copies, which count as optimizer
    state as in the ZeRO paper's accounting). ``host`` and ``disk`` name the counted tensors that live on the host
    and in files (offload); ``buffers`` and ``host_buffers`` are the kept buffers on the training device and on the
    host, counted apart.
    """
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
    params = list(module.parameters()) + list(extra_params)
    grads = [p.grad for p in module.parameters() if p.grad is not None] + list(extra_grads)
    states = list(extra_optimizer) + [v for o in optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
    seen: set[tuple[torch.device, int]] = set()
    optimizer = _storage_bytes(states, seen)  # first: a stage-3 parameter between uses holds its fp32 master
    params_bytes, grads_bytes = _storage_bytes(params, seen), _storage_bytes(grads, seen)
    host_buffers_bytes = _storage_bytes(host_buffers, set())
    return ModelStateBytes(
        params_bytes, grads_bytes, optimizer, host=_storage_bytes(host, set()), disk=_storage_bytes(disk, set()),
        buffers=_storage_bytes(buffers, set()) + host_buffers_bytes, buffers_host=host_buffers_bytes,
    )


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[torch.device, int]]) -> int:
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total
