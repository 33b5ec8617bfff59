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
    """Bytes of one rank's model states by kind."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_state_bytes(
    module: nn.Module, optimizers: Iterable[Optimizer] = (), extra_grad_buffers: Iterable[torch.Tensor] = ()
) -> ModelStateBytes:
    """Bytes of the parameters of ``module`` and ``optimizers``, their gradients and the optimizers' states.

    ``extra_grad_buffers`` adds gradient storage held outside ``.grad`` (e.g. a reducer's persistent shard buffers).
    """
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
    module_params = list(module.parameters())
    dtypes = {p.dtype for p in module_params}
    stepped = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    # fp32 master copies of 16-bit parameters are optimizer state, as in the ZeRO paper's accounting.
    masters = [p for p in stepped if p.dtype not in dtypes]
    params = module_params + [p for p in stepped if p.dtype in dtypes]
    grads = [p.grad for p in params + masters if p.grad is not None] + list(extra_grad_buffers)
    states = masters + [v for o in optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
    seen: set[tuple[torch.device, int]] = set()
    return ModelStateBytes(
        params=_storage_bytes(params, seen), grads=_storage_bytes(grads, seen), optimizer=_storage_bytes(states, seen)
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
