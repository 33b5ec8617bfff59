"""Whole-parameter ownership: an optimizer whose update is not element-wise steps each parameter whole, on one rank.

[Note: which optimizers are sharded by rows, and which own whole parameters]
ZeRO's optimizer shards are rows of every parameter (flat_param.py, [Note: how a parameter is split]): right for an
update that treats each element on its own (Adam, SGD, ...), silently wrong for one that looks at a whole matrix
(Muon orthogonalizes it, Adafactor keeps its row and column statistics, LARS and LAMB scale it by its norm). So each
optimizer gets one of two layouts (``ZeroConfig.optimizer_sharding``):

* ``"rows"``: the optimizer steps this rank's rows of every parameter (the ZeRO paper's layout);
* ``"params"``: every parameter is *owned* whole by one rank (``assign_owners``, balanced by step cost and bytes),
  which keeps its optimizer state and steps it whole, with the user's own optimizer object (its ``param_groups``,
  hyper-parameters and LR schedulers), restricted to the parameters it owns;
* ``"auto"`` (the default): ``"rows"`` for torch's element-wise classes (``ELEMENT_WISE``, and subclasses that
  inherit their ``step``), ``"params"`` for everything else: torch's ``Muon`` and ``Adafactor``, and any class of
  the user's, which ownership steps correctly whenever it steps each parameter from its own gradient and state,
  also one that mixes matrix and element-wise groups. ``LBFGS`` and ``SparseAdam`` (a closure re-evaluated over all
  parameters at once; sparse gradients) are refused, naming why.

Everything outside the optimizer is unchanged: gradients are reduce-scattered into rows and parameters gathered from
rows, at every stage, so memory and checkpoints keep their layout. What ownership adds is in the step
(``ShardedOptimizer._update_owned``): each rank sends its rows of every owned parameter's gradient and master to
the owner (one ``all_to_all``), the owner steps the whole parameters it owns, and sends each rank its rows of the updated masters
back (one more); a reduce-scatter followed by that gather moves what a reduce to the owner does, so the bytes stay
at the ZeRO figures plus ``2 Psi (N-1)/N^2`` for the masters' round trip. Each matrix is stepped once in the world
instead of once per rank as under DDP: with Muon that is most of a step's work saved. The optimizer state is the
owner's, so its bytes per rank follow the assignment (``owned_elements`` gives them, and their imbalance); a checkpoint
holds it as rows like any other (``ShardedOptimizer.state_dict``), so it reloads at another world size, stage or
layout. Offloading the states of an owned optimizer is not implemented and is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.flat_param import ParamShard, ShardSpec

#: torch's optimizers whose update treats each element on its own.
ELEMENT_WISE = ("Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
#: torch's optimizers that ownership cannot step either, and why.
COUPLED = {
    "LBFGS": "it re-evaluates the closure and takes dot products over all parameters at once",
    "SparseAdam": "it needs sparse gradients, which are never reduce-scattered",
}
#: torch's optimizers known not to be element-wise (refused with ``optimizer_sharding="rows"``).
MATRIX_WISE = {"Muon": "it orthogonalizes whole weight matrices",
               "Adafactor": "its factored second moments are row and column statistics of whole matrices"}
SHARDING_MODES = ("auto", "rows", "params")


def sharding_mode(optimizer: Optimizer, option: str) -> str:
    """``"rows"`` or ``"params"`` for ``optimizer`` under ``optimizer_sharding=option`` (see [Note: which
    optimizers are sharded by rows, and which own whole parameters]); raises for an optimizer neither can step."""
    name = type(optimizer).__name__
    torch_base = _torch_base(type(optimizer))
    if torch_base in COUPLED:
        raise ValueError(
            f"{name} cannot be sharded by ZeroStrategy: {COUPLED[torch_base]}; use an optimizer that steps each "
            "parameter from its own gradient (any torch.optim class but LBFGS and SparseAdam, or your own)"
        )
    if option == "rows" and torch_base in MATRIX_WISE:
        raise ValueError(
            f"optimizer_sharding='rows' cannot step {name}: {MATRIX_WISE[torch_base]}, and rows are slices of "
            "them; use optimizer_sharding='auto' or 'params' (each parameter stepped whole by one rank)"
        )
    if option in ("rows", "params"):
        return option
    return "rows" if is_element_wise(type(optimizer)) else "params"


def is_element_wise(cls: type) -> bool:
    """Whether ``cls`` is one of torch's element-wise optimizers, or a subclass that keeps its update (``step``
    inherited): only then are rows of a parameter stepped as the whole would be."""
    for base in cls.__mro__:
        if base.__module__.startswith("torch.optim") and base.__name__ in ELEMENT_WISE:
            return cls.step is base.step
    return False


def _torch_base(cls: type) -> str | None:
    for base in cls.__mro__:
        if base.__module__.startswith("torch.optim") and base.__name__ != "Optimizer" and base is not object:
            return base.__name__
    return None


def step_cost(shape: torch.Size) -> int:
    """What stepping a parameter of ``shape`` whole costs, in multiply-adds: a matrix's orthogonalization grows with
    ``rows * cols * min(rows, cols)`` (Muon's Newton-Schulz iterations, on the matrix of the first dimension by the
    rest); anything else with its size."""
    if len(shape) < 2:
        return max(1, math.prod(shape))
    rows, cols = shape[0], math.prod(shape[1:])
    return rows * cols * min(rows, cols)


def assign_owners(shapes: Sequence[torch.Size], world_size: int,
                  taken: Sequence[tuple[torch.Size, int]] = ()) -> list[int]:
    """The owning rank of each parameter of ``shapes``, the same on every rank: largest step cost first, each to the
    rank whose share of the step cost and of the bytes, the larger of the two, grows least. ``taken``: parameters
    that have an owner already (an optimizer's first groups, before ``add_param_group``), counted in the loads."""
    every = [*(shape for shape, _ in taken), *shapes]
    total_cost = sum(step_cost(s) for s in every) or 1
    total_size = sum(math.prod(s) for s in every) or 1
    cost, size = [0.0] * world_size, [0.0] * world_size
    for shape, rank in taken:
        cost[rank] += step_cost(shape) / total_cost
        size[rank] += math.prod(shape) / total_size
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-step_cost(shapes[i]), i)):
        c, b = step_cost(shapes[i]) / total_cost, math.prod(shapes[i]) / total_size
        rank = min(range(world_size), key=lambda r: (max(cost[r] + c, size[r] + b), r))
        cost[rank] += c
        size[rank] += b
        owners[i] = rank
    return owners


def owned_elements(shapes: Sequence[torch.Size], world_size: int) -> list[int]:
    """How many parameter elements each rank owns under ``assign_owners``: an owned optimizer's per-element state
    per rank is this times its bytes per element (the estimate of the state's memory and its imbalance)."""
    per_rank = [0] * world_size
    for shape, rank in zip(shapes, assign_owners(shapes, world_size)):
        per_rank[rank] += math.prod(shape)
    return per_rank


class Ownership:
    """The owners of an optimizer's parameters over ``comms`` (the shard group), and the exchanges of a step: rows to
    their owners, updated masters back (see [Note: which optimizers are sharded by rows, and which own whole
    parameters])."""

    def __init__(self, comms: Collectives) -> None:
        self.comms = comms
        self.owners: dict[ParamShard, int] = {}
        self.rank, self.world_size = comms.rank, comms.world_size

    def assign(self, shards: Sequence[ParamShard]) -> None:
        """Owners for the parameters of ``shards`` that have none yet."""
        new = [s for s in shards if s not in self.owners]
        if new:
            taken = [(s.spec.shape, rank) for s, rank in self.owners.items()]
            self.owners.update(zip(new, assign_owners([s.spec.shape for s in new], self.world_size, taken)))

    def owned(self, shards: Sequence[ParamShard]) -> list[ParamShard]:
        """Those of ``shards`` this rank owns."""
        return [s for s in shards if self.owners[s] == self.rank]

    def _rows(self, shard: ParamShard, rank: int) -> int:
        """How many elements of ``shard``'s parameter rank ``rank`` holds."""
        lo, hi = ShardSpec(shard.spec.shape, rank, self.world_size).owned_rows()
        return (hi - lo) * shard.spec.row_numel

    @torch.no_grad()
    def to_owners(self, items: Sequence[tuple[ParamShard, Sequence[Tensor]]], like: Tensor,
                  what: str) -> dict[ParamShard, list[Tensor]]:
        """Each item's tensors (this rank's rows of its parameter, of ``like``'s dtype and device), whole on the
        parameter's owner: returns the owned ones, each tensor of the parameter's full shape."""
        by_owner = self._by_owner(items)
        send = [t.reshape(-1) for owner in by_owner for _, tensors in owner for t in tensors]
        send_counts = [sum(t.numel() for _, tensors in owner for t in tensors) for owner in by_owner]
        mine = by_owner[self.rank]
        recv_counts = [sum(self._rows(s, r) * len(tensors) for s, tensors in mine) for r in range(self.world_size)]
        recv = self.comms.all_to_all(_cat(send, like), send_counts, recv_counts, what)
        from_rank = [list(part.split([self._rows(s, r) for s, tensors in mine for _ in tensors]))
                     for r, part in enumerate(recv.split(recv_counts))]
        whole: dict[ParamShard, list[Tensor]] = {}
        position = 0
        for shard, tensors in mine:
            whole[shard] = [torch.cat([from_rank[r][position + k] for r in range(self.world_size)]).view(shard.spec.shape)
                            for k in range(len(tensors))]
            position += len(tensors)
        return whole

    @torch.no_grad()
    def from_owners(self, items: Sequence[tuple[ParamShard, Tensor | None]], like: Tensor, what: str) -> list[Tensor]:
        """The reverse of ``to_owners``: ``items`` pairs parameters (one may come more than once) with a whole
        tensor where this rank owns the parameter (``None`` elsewhere), of ``like``'s dtype and device; returns this
        rank's rows of each item's tensor, in the order of ``items``."""
        by_owner = self._by_owner([(s, (i, t)) for i, (s, t) in enumerate(items)])
        mine = by_owner[self.rank]
        send = [self._row_block(s, t, r).reshape(-1) for r in range(self.world_size) for s, (_, t) in mine]
        send_counts = [sum(self._rows(s, r) for s, _ in mine) for r in range(self.world_size)]
        recv_counts = [sum(self._rows(s, self.rank) for s, _ in owner) for owner in by_owner]
        recv = self.comms.all_to_all(_cat(send, like), send_counts, recv_counts, what)
        order = [(i, s) for owner in by_owner for s, (i, _) in owner]
        pieces = recv.split([self._rows(s, self.rank) for _, s in order])
        rows: list[Tensor] = [like] * len(items)
        for (i, shard), piece in zip(order, pieces):
            rows[i] = piece.view(shard.spec.local_shape)
        return rows

    def _row_block(self, shard: ParamShard, whole: Tensor, rank: int) -> Tensor:
        return ShardSpec(shard.spec.shape, rank, self.world_size).local_view(whole)

    def _by_owner(self, items):
        by_owner: list[list] = [[] for _ in range(self.world_size)]
        for shard, tensors in items:
            by_owner[self.owners[shard]].append((shard, tensors))
        return by_owner


def _cat(tensors: list[Tensor], like: Tensor) -> Tensor:
    return torch.cat(tensors) if tensors else like.new_empty(0)
