"""ShardedOptimizer: the user's own torch optimizer, stepping only this rank's shards.

[Note: the user's optimizer object is kept, and so are its param_groups]
``configure_optimizers`` builds an optimizer over the module's parameters, and its ``param_groups`` keep exactly
those parameters: code that looks parameters up there (Lightning's ``toggle_optimizer``, ``BaseFinetuning``'s
``add_param_group``, LR schedulers, the user's own) finds what it expects, and the object pickles as it did. Only for
the duration of an update (and of a state-dict load) does each parameter's ``.data`` become its local shard (the fp32
master under mixed precision), its ``.grad`` the reduced gradient shard, in the master's dtype, and a sharded stage-3
parameter its own class again (see [Note: a sharded parameter keeps its shape]); then all three are put back. So the optimizer's per-parameter state is shard-sized, keyed by the module's parameters, and any ``torch.optim``
class that updates element-wise works (Adam, AdamW, SGD with momentum, Adagrad, ...). Optimizers whose update depends
on a parameter's full shape or on all parameters at once (LBFGS, Adafactor's factored moments, Muon, SparseAdam) are
refused when the strategy shards them, with the reason.

State an optimizer created before it was sharded (Adagrad fills its sums in ``__init__``) is cut to the local rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.memory import MappedPages
from lightning_zero.sharding.flat_param import ParamShard

#: Optimizers whose update is not element-wise, and why ZeRO cannot step them on row shards.
NOT_ELEMENT_WISE = {
    "LBFGS": "it re-evaluates the closure and takes dot products over all parameters at once",
    "SparseAdam": "it needs sparse gradients, which are never reduce-scattered",
    "Adafactor": "its factored second moments are row and column statistics of whole matrices",
    "Muon": "it orthogonalizes whole weight matrices",
}


class ShardedOptimizer:
    """Steps ``optimizer`` on the local shards of its parameters (see the module docstring)."""

    def __init__(self, optimizer: Optimizer, shard_of: dict[torch.nn.Parameter, ParamShard],
                 keep_rows: Callable[[Tensor], Tensor] = Tensor.clone) -> None:
        name = type(optimizer).__name__
        for base in type(optimizer).__mro__:
            if base.__name__ in NOT_ELEMENT_WISE and base.__module__.startswith("torch.optim"):
                raise ValueError(
                    f"{name} cannot be sharded by ZeroStrategy: {NOT_ELEMENT_WISE[base.__name__]}; ZeRO steps each "
                    "rank's rows of every parameter separately, so only element-wise optimizers (Adam, AdamW, SGD, "
                    "Adagrad, ...) are supported"
                )
        self.optimizer = optimizer
        self._shard_of = shard_of
        #: How this rank's rows of a loaded full-shape state are kept: a copy in memory, or where offload keeps
        #: states (disk offload: straight into a file, so a resume never holds every state in memory at once).
        self._keep_rows = keep_rows
        with torch.no_grad():
            self._shard_existing_state()

    @property
    def shards(self) -> list[ParamShard]:
        """The shards of the optimizer's parameters, in ``param_groups`` order (groups may have been added since)."""
        shards = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                shard = self._shard_of.get(param)
                if shard is None:
                    raise ValueError(
                        f"{type(self.optimizer).__name__} holds a parameter of shape {tuple(param.shape)} that is not "
                        "a parameter of the LightningModule; ZeRO can only shard the module's own parameters"
                    )
                shards.append(shard)
        return shards

    def _shard_existing_state(self) -> None:
        for shard in self.shards:
            state = self.optimizer.state.get(shard.param)
            for key, value in (state or {}).items():
                if is_per_element(key, value, shard.spec.shape, shard):
                    state[key] = shard.spec.local_view(value).clone()

    # ------------------------------------------------------------------------------------------------------ the step

    def shards_with_grads(self) -> list[ParamShard]:
        """The shards whose ``param.grad`` holds a reduced gradient shard (at world size 1 with the short cut,
        autograd's own gradient: a 0-d parameter's is 0-d, its shard's shape is ``(1,)``)."""
        return [s for s in self.shards if s.param.grad is not None and _is_shard_grad(s, s.param.grad)]

    def step_grads(self) -> list[tuple[ParamShard, Tensor]]:
        """The reduced gradient shards in the masters' dtype, for shards that have one: the shards themselves when
        the dtypes agree (fp32), else fp32 copies that live for this step only (16-bit working gradients)."""
        out = []
        for shard in self.shards_with_grads():
            grad = shard.param.grad.view(shard.spec.local_shape)
            out.append((shard, grad if grad.dtype == shard.local.dtype else grad.to(shard.local.dtype)))
        return out

    @torch.no_grad()
    def update(self, grads: list[tuple[ParamShard, Tensor]], only: list[ParamShard] | None = None, **kwargs: Any) -> Any:
        """Run the user's ``optimizer.step()`` with the shards swapped in (see the module docstring); ``only``
        restricts the step to those shards (offload steps group by group), each group keeping its settings."""
        with self._swapped_in(dict(grads), only), self._restricted_to(only):
            return self.optimizer.step(**kwargs)

    @contextmanager
    def _restricted_to(self, only: list[ParamShard] | None) -> Iterator[None]:
        if only is None:
            yield
            return
        keep = {s.param for s in only}
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        for group in groups:
            group["params"] = [p for p in group["params"] if p in keep]
        try:
            yield
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params

    @contextmanager
    def _swapped_in(
        self, grads: dict[ParamShard, Tensor] | None = None, only: list[ParamShard] | None = None
    ) -> Iterator[None]:
        saved = []
        for shard in self.shards if only is None else only:
            param = shard.param
            saved.append((shard, param.data, param.grad, type(param)))
            param.__class__ = shard.param_class  # a sharded stage-3 parameter: its shard's values are read here
            param.data = shard.local
            if grads is not None:
                param.grad = grads.get(shard)
        try:
            yield
        finally:
            for shard, data, grad, cls in saved:
                shard.param.data = data
                shard.param.__class__ = cls
                shard.set_grad_shard(grad)
                shard.mark_written()  # the update bumped the version counter; the full values follow the shards

    # ------------------------------------------------------------------------------------------------- state dicts

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load shard-shaped state (torch casts it to the parameters it sees, so the masters are swapped in)."""
        with self._swapped_in():
            self.optimizer.load_state_dict(state_dict)

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full-shape optimizer state dict (as DDP or ``consolidate --training-state`` writes it)."""
        groups = state_dict["param_groups"]
        shards = self.shards
        saved = sum(len(g["params"]) for g in groups)
        if saved != len(shards):
            raise ValueError(
                f"the checkpoint's {type(self.optimizer).__name__} state covers {saved} parameters but this optimizer "
                f"has {len(shards)}"
            )
        local_state: dict[int, dict[str, Any]] = {}
        mapped = MappedPages()
        for index, entry in state_dict["state"].items():
            shard = shards[int(index)]
            local_state[index] = {}
            for key, value in entry.items():
                if is_per_element(key, value, shard.spec.shape, shard):
                    rows = shard.spec.local_view(value)
                    value = self._keep_rows(rows)
                    mapped.release(rows)  # as in ZeroRuntime.load_full_state_dict
                elif torch.is_tensor(value) and value.dim() > 0:
                    raise ValueError(
                        f"optimizer state {key!r} of parameter {shard.name!r} has shape {tuple(value.shape)}, "
                        f"expected {tuple(shard.spec.shape)}"
                    )
                elif torch.is_tensor(value):  # a scalar (``step``): a view of a mapped checkpoint file would keep
                    value = value.clone()     # the whole mapping, and every page a rank read from it, resident
                local_state[index][key] = value
        self.load_state_dict({"state": local_state, "param_groups": groups})


def _is_shard_grad(shard: ParamShard, grad: Tensor) -> bool:
    spec = shard.spec
    return grad.shape == spec.local_shape or (spec.world_size == 1 and grad.shape == spec.shape)


def is_per_element(key: str, value: Any, shape: torch.Size, shard: ParamShard) -> bool:
    """Whether an optimizer state entry has one element per parameter element (moments, momentum buffers).

    Judged by shape. A 0-d parameter's moments are 0-d like the scalar ``step`` counter, so that key is excluded.
    """
    if not torch.is_tensor(value) or value.shape != shape:
        return False
    return len(shard.spec.shape) > 0 or key != "step"
