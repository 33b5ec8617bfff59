"""ShardedOptimizer: the user's own torch optimizer, stepping only this rank's shards (or the whole parameters this rank
owns, for an optimizer that is not element-wise: ownership.py).

[Note: the user's optimizer object is kept, and so are its param_groups]
``configure_optimizers`` builds an optimizer over the module's parameters, and its ``param_groups`` keep exactly
those parameters: code that looks parameters up there (Lightning's ``toggle_optimizer``, ``BaseFinetuning``'s
``add_param_group``, LR schedulers, the user's own) finds what it expects, and the object pickles as it did. Only for
the duration of an update (and of a state-dict load) does each parameter's ``.data`` become its local shard (the fp32
master under mixed precision; a whole master on its owner under ownership), its ``.grad`` the reduced gradient shard,
in the master's dtype, and a sharded stage-3 parameter its own class again (see [Note: a sharded parameter keeps its
shape]); then all three are put back. So the optimizer's per-parameter state is shard-sized (or whole, on the owner),
keyed by the module's parameters, and every ``torch.optim`` class but LBFGS and SparseAdam works, as does a user's own
(see [Note: which optimizers are sharded by rows, and which own whole parameters] in ownership.py).

State an optimizer created before it was sharded (Adagrad fills its sums in ``__init__``) is cut to the local rows,
or kept whole by the owner.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.memory import MappedPages
from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.ownership import Ownership, sharding_mode
from lightning_zero.sharding.sharded_param import placeholder, plain_data

class ShardedOptimizer:
    """Steps ``optimizer`` on the local shards of its parameters (see the module docstring), or, for an optimizer
    that is not element-wise, on the whole parameters this rank owns (``sharding``: ``"auto"``, ``"rows"`` or
    ``"params"``; see [Note: which optimizers are sharded by rows, and which own whole parameters] in
    ownership.py). ``comms``: the shard group (``None``: one rank)."""

    def __init__(self, optimizer: Optimizer, shard_of: dict[torch.nn.Parameter, ParamShard],
                 keep_rows: Callable[[Tensor], Tensor] = Tensor.clone, comms: Collectives | None = None,
                 sharding: str = "auto") -> None:
        self.optimizer = optimizer
        self._shard_of = shard_of
        #: How this rank's rows of a loaded full-shape state are kept: a copy in memory, or where offload keeps
        #: states (disk offload: straight into a file, so a resume never holds every state in memory at once).
        self._keep_rows = keep_rows
        #: ``"rows"`` or ``"params"``: the layout this optimizer is stepped in.
        self.sharding = sharding_mode(optimizer, sharding)
        #: Who owns each parameter (``"params"`` on more than one rank; ``None`` otherwise: rows are whole then).
        self.ownership = Ownership(comms) if self.sharding == "params" and comms is not None and not comms.local else None
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
        """State the optimizer made in its constructor (Adagrad's sums): this rank's rows, or, where whole
        parameters are owned, the owner's whole state."""
        owned = set(self._owned(self.shards))
        for shard in self.shards:
            state = self.optimizer.state.get(shard.param)
            if state and self.ownership is not None:
                if shard not in owned:
                    del self.optimizer.state[shard.param]
                continue
            for key, value in (state or {}).items():
                if is_per_element(key, value, shard.spec.shape, shard):
                    state[key] = shard.spec.local_view(value).clone()

    @property
    def cuts_rows(self) -> bool:
        """Whether the optimizer's state is cut into rows (row shards on more than one rank): only state with one
        element per parameter element can be cut."""
        return self.sharding == "rows" and any(s.spec.world_size > 1 for s in self.shards)

    def _owned(self, shards: list[ParamShard]) -> list[ParamShard]:
        """Those of ``shards`` whose whole parameter this rank steps (all of them without ownership)."""
        if self.ownership is None:
            return shards
        self.ownership.assign(self.shards)
        return self.ownership.owned(shards)

    # ------------------------------------------------------------------------------------------------------ the step

    def shards_with_grads(self) -> list[ParamShard]:
        """The shards whose parameter has a gradient for the step (``ParamShard.grad_rows``)."""
        return [s for s in self.shards if s.param.grad is not None]

    def step_grads(self) -> list[tuple[ParamShard, Tensor]]:
        """The reduced gradient shards in the masters' dtype, for shards that have one: the shards themselves when
        the dtypes agree (fp32), else fp32 copies that live for this step only (16-bit working gradients)."""
        out = []
        for shard in self.shards_with_grads():
            grad = shard.grad_rows()
            out.append((shard, grad if grad.dtype == shard.local.dtype else grad.to(shard.local.dtype)))
        return out

    @torch.no_grad()
    def update(self, grads: list[tuple[ParamShard, Tensor]], only: list[ParamShard] | None = None, **kwargs: Any) -> Any:
        """Run the user's ``optimizer.step()`` with the shards swapped in (see the module docstring); ``only``
        restricts the step to those shards (offload steps group by group), each group keeping its settings. Under
        ownership the rows go to their owners first and the updated masters come back (``Ownership``)."""
        if self.ownership is not None:
            return self._update_owned(grads, **kwargs)
        with self._swapped_in(dict(grads), only), self._restricted_to(only):
            return self.optimizer.step(**kwargs)

    def _update_owned(self, grads: list[tuple[ParamShard, Tensor]], **kwargs: Any) -> Any:
        """Ownership's step (ownership.py): gradients and masters whole on their owners, the owner steps them, each
        rank gets its rows of the new masters back."""
        ownership = self.ownership
        owned = self._owned([s for s, _ in grads])
        whole: dict[ParamShard, list[Tensor]] = {}
        for group in _by_dtype(grads):
            items = [(shard, [grad, shard.local]) for shard, grad in group]
            whole.update(ownership.to_owners(items, group[0][0].local, "gradients and masters to their owners"))
        with self._swapped_in({s: whole[s][0] for s in owned}, owned, {s: whole[s][1] for s in owned}), \
                self._restricted_to(owned):
            output = self.optimizer.step(**kwargs)
        for group in _by_dtype(grads):
            items = [(shard, whole[shard][1] if shard in whole else None) for shard, _ in group]
            rows = ownership.from_owners(items, group[0][0].local, "updated masters from their owners")
            for (shard, _), new in zip(group, rows):
                shard.local.copy_(new)
        return output

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
        self, grads: dict[ParamShard, Tensor] | None = None, only: list[ParamShard] | None = None,
        data: dict[ParamShard, Tensor] | None = None,
    ) -> Iterator[None]:
        """Each shard's parameter holds its master (``data``'s tensor where given: a whole owned one) and
        ``grads``' gradient while inside."""
        saved = []
        for shard in self.shards if only is None else only:
            param = shard.param
            saved.append((shard, plain_data(param), param.grad, type(param)))
            param.__class__ = shard.param_class  # a sharded stage-3 parameter: its shard's values are read here
            param.data = shard.local if data is None or shard not in data else data[shard]
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
        """Load shard-shaped state, or under ownership the owned parameters' whole state (torch casts it to the
        parameters it sees, so tensors of the masters' dtype, device and shape are swapped in)."""
        whole = None
        if self.ownership is not None:
            whole = {s: placeholder(s.spec.shape, s.local.dtype, s.local.device) for s in self._owned(self.shards)}
        with self._swapped_in(data=whole):
            self.optimizer.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` with every per-element state as this rank's rows, whatever the layout
        (what a checkpoint saves: ``checkpoint/sharded.py``). Under ownership the owners send each rank its rows of
        the states they hold, and the other entries (step counters, factored statistics) go to every rank."""
        state = self.optimizer.state_dict()
        if self.ownership is None:
            return state
        shards = self.shards
        held = {i: {k: (str(v.dtype), True) if is_per_element(k, v, shards[i].spec.shape, shards[i]) else (v, False)
                    for k, v in entry.items()} for i, entry in state["state"].items()}
        layout = {i: entry for part in self.ownership.comms.all_gather_object(
            {i: {k: (v.cpu() if torch.is_tensor(v) else v, per) for k, (v, per) in e.items()} for i, e in held.items()}
        ) for i, entry in part.items()}
        rows: dict[int, dict[str, Any]] = {i: {k: v for k, (v, per) in entry.items() if not per} for i, entry in layout.items()}
        keyed = sorted((i, k) for i, entry in layout.items() for k, (_, per) in entry.items() if per)
        for dtype in sorted({layout[i][k][0] for i, k in keyed}):
            pairs = [(i, k) for i, k in keyed if layout[i][k][0] == dtype]
            items = [(shards[i], state["state"][i][k] if i in state["state"] else None) for i, k in pairs]
            like = torch.empty(0, dtype=getattr(torch, dtype.split(".")[-1]), device=shards[pairs[0][0]].local.device)
            received = self.ownership.from_owners(items, like, "optimizer states as rows (checkpoint)")
            for (i, k), value in zip(pairs, received):
                rows[i][k] = value
        return {"state": dict(sorted(rows.items())), "param_groups": state["param_groups"]}

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
        owned = set(self._owned(shards))
        for index, entry in state_dict["state"].items():
            shard = shards[int(index)]
            if shard not in owned:
                continue  # another rank owns the whole parameter and loads its state
            local_state[index] = {}
            for key, value in entry.items():
                if is_per_element(key, value, shard.spec.shape, shard):
                    rows = value if self.ownership is not None else shard.spec.local_view(value)
                    value = self._keep_rows(rows)
                    mapped.release(rows)  # as in ZeroRuntime.load_full_state_dict
                elif torch.is_tensor(value) and value.dim() > 0 and self.cuts_rows:
                    raise ValueError(
                        f"optimizer state {key!r} of parameter {shard.name!r} has shape {tuple(value.shape)}, "
                        f"expected {tuple(shard.spec.shape)}"
                    )
                elif torch.is_tensor(value):  # a scalar (``step``), or a whole parameter's statistics: a view of a
                    value = value.clone()     # mapped checkpoint file would keep the mapping and its pages resident
                local_state[index][key] = value
        self.load_state_dict({"state": local_state, "param_groups": groups})


def is_per_element(key: str, value: Any, shape: torch.Size, shard: ParamShard) -> bool:
    """Whether an optimizer state entry has one element per parameter element (moments, momentum buffers).

    Judged by shape. A 0-d parameter's moments are 0-d like the scalar ``step`` counter, so that key is excluded.
    """
    if not torch.is_tensor(value) or value.shape != shape:
        return False
    return len(shard.spec.shape) > 0 or key != "step"


def _by_dtype(grads: list[tuple[ParamShard, Tensor]]) -> list[list[tuple[ParamShard, Tensor]]]:
    """``grads`` grouped by their masters' dtype (one exchange per dtype), in order."""
    groups: dict[torch.dtype, list[tuple[ParamShard, Tensor]]] = {}
    for shard, grad in grads:
        groups.setdefault(shard.local.dtype, []).append((shard, grad))
    return list(groups.values())
