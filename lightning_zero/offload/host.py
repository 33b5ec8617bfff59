"""Optimizer offload: the fp32 master shards and the optimizer states live off the training device, and the step runs
on the host (ZeRO-Offload).

[Note: one offloaded step]
Between steps the device holds what compute needs: the working parameters (stages 1-2: full; stage 3: this rank's
rows, ``ParamShard.working``, or none with ``offload_params``) and the reduced gradient shards; the host holds the
fp32 masters (``ParamShard.local``) and, created there by the optimizer itself, its states: for Adam in mixed
precision 2Ψ + 2Ψ/N on the device and 12Ψ/N on the host (fp32: 4Ψ + 4Ψ/N and 12Ψ/N). At the step, after the global
norm and the clip factor are agreed on the device as without offload, the shards are walked in groups (``bucket_mb``
of parameters; with disk offload, the sub-groups whose states are read back first):

1. each group's gradient shards are copied to a host arena on the side stream, one ticket per group (all issued at
   once; they complete in order);
2. group by group, the host waits for *that group's* ticket, makes fp32 gradients (times the clip factor), runs the
   user's optimizer on that group alone, and writes the updated masters, cast to the working dtype, where the gathers
   read them: through a host arena and a copy on the side stream to the device, or straight into the host rows
   (``offload_params``). So the copies of later groups overlap the host step of earlier ones;
3. the compute stream waits on the tickets of the rows copied to the device, then stages 1-2 all-gather the updated
   rows as usual. After a checkpoint is loaded into the masters (``refresh``) the same push runs for every shard.

Every copy goes through ``Transfers`` and every buffer through a ``HostArena`` (staging.py: [Note: copies between
host and device], [Note: host arenas]). Without a CUDA device the code is the same with plain (synchronous) copies,
and no arena: the gradient shards already live in host memory, so each group makes its fp32 gradients straight from
them, and the updated rows are cast straight into the working shards; a CPU run holds no staging copy of either
(measured in benchmarks/offload_rss.py: wΨ/N less peak RSS).

[Note: ZeRO++ with offload]
ZeRO++'s three options (stage 3's qwZ and hpZ, qgZ under every stage) change what the collectives move on the
training device, never where the masters and optimizer states live or what the host step reads and writes, so they
compose with every offload as they are:

* qwZ: a unit's gather packs this rank's rows into its segment of the device buffer first, as unquantized:
  with ``offload_params`` that pack is the copy from the host rows (or from disk offload's unit buffer, ``staged``),
  guarded by the same ticket; the int8 payload is quantized from that device segment into a device table, which is
  all-gathered. Every tensor handed to the collective is on the device, and nothing else reads the host rows.
* hpZ: the secondary shard is a slice of the gathered device storage, kept on the device, and the backward gather
  runs from it inside the hpZ group: it reads neither the host rows nor disk offload's files (one copy in, or one read
  from disk, less per unit and step), and the host holds nothing more. On the device it adds ``Psi * b / K2`` from a
  unit's forward to its backward, as without offload, where ``offload_params`` otherwise keeps only gradient shards.
* qgZ: the two-stage exchange reduces the device bucket into its segment, which is stored as a gradient shard where
  the offload keeps them (``grad_storage``: the device, or files on a host run with disk offload), then copied to the
  host arena at the step as any gradient shard.

So the offloaded run gathers, reduces and steps bitwise as the in-memory run with the same options when both step
with the same optimizer implementation (tests/distributed/test_zeropp_offload.py).

The optimizer runs torch's fused CPU kernel when its class has one (Adam, AdamW, SGD, Adagrad) and the user did not
ask for another implementation: measured on one H200 machine's 16 host cores for 1.3B parameters, fused AdamW takes
231 ms, foreach 1,093 ms (shared/gpu/README.md); on this project's 2 cores, 112 ms against 724 ms for 32M.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_zero.offload.staging import HostArena, Slot, Ticket, Transfers, plan_slots
from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.optimizer import ShardedOptimizer

#: Optimizer classes with a fused CPU kernel in torch (``fused=True``).
_FUSED_ON_CPU = ("Adam", "AdamW", "SGD", "Adagrad")


def _fused_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups of ``optimizer`` (a torch class with a fused CPU kernel) that chose no implementation."""
    if type(optimizer).__name__ not in _FUSED_ON_CPU or "fused" not in optimizer.defaults:
        return []
    return [group for group in optimizer.param_groups if group.get("fused") is None
            and group.get("foreach") is None and not group.get("differentiable")]


@contextmanager
def fused_on_host(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, ``optimizer``'s groups that chose no implementation step with torch's fused CPU kernel; on exit they
    hold what the user gave again (``None``), so that the user's ``param_groups`` and checkpoints never change. A
    group that chose (``fused`` or ``foreach`` given, ``False`` included) keeps its choice: ``foreach=False`` is
    torch's single-tensor loop, which DDP runs on CPU tensors by default, and with it DDP's results to the bit; the
    fused kernel rounds a few elements differently, by one ulp (0.75% of 10M AdamW elements after two steps)."""
    groups = _fused_groups(optimizer)
    for group in groups:
        group["fused"], group["foreach"] = True, False
    try:
        yield
    finally:
        for group in groups:
            group["fused"], group["foreach"] = None, None


class HostOffload:
    """Keeps ``shards``' masters in host memory and runs the step there (see [Note: one offloaded step]).

    ``stage``: stages 1-2 write the updated rows into the full parameter's own rows (then all-gathered); stage 3 into
    a device-side working shard, or, with ``params_on_host``, a host one (in an arena) the unit gathers read.
    ``grad_dtype``: the dtype of the reduced gradient shards (the reduction's).
    """

    def __init__(self, shards: Sequence[ParamShard], stage: int, group_bytes: int, transfers: Transfers,
                 grad_dtype: torch.dtype | None = None, params_on_host: bool = False) -> None:
        self.shards = list(shards)
        self.group_bytes = group_bytes
        self.transfers = transfers
        self.params_on_host = params_on_host
        #: Host arenas of the pipeline, by purpose (none without a CUDA device: nothing is staged).
        self.arenas: dict[str, HostArena] = {}
        self._grad_rows: dict[ParamShard, Tensor] = {}
        self._updated_rows: dict[ParamShard, Tensor] = {}
        #: The last copy that read each shard's host rows (a gather's pack, a push): written again only after it.
        self._last_read: dict[ParamShard, Ticket] = {}
        self._plan_staging(grad_dtype)
        with torch.no_grad():
            for shard in self.shards:
                self._place(shard, stage)

    def _plan_staging(self, grad_dtype: torch.dtype | None) -> None:
        """One arena per purpose, sized from the shards (see [Note: host arenas]); only where copies cross to a
        device."""
        if not self.transfers.stages:
            return
        floating = [s for s in self.shards if s.spec.local_numel]

        def arena(purpose: str, dtype_of) -> dict[ParamShard, Tensor]:
            slots, nbytes = plan_slots([(s.spec.local_shape, dtype_of(s)) for s in floating])
            self.arenas[purpose] = HostArena(purpose, nbytes, pinned=self.transfers.pinned)
            return {s: self.arenas[purpose].view(slot) for s, slot in zip(floating, slots)}

        self._grad_rows = arena("gradient shards", lambda s: grad_dtype if s.dtype.is_floating_point and grad_dtype
                                else s.dtype)
        self._updated_rows = arena("parameter shards" if self.params_on_host else "updated rows", lambda s: s.dtype)

    def _place(self, shard: ParamShard, stage: int) -> None:
        master = torch.empty(shard.spec.local_shape, dtype=torch.float32 if shard.dtype.is_floating_point else
                             shard.dtype)
        master.copy_(shard.local)
        if stage < 3:
            shard.working = shard.spec.local_view(shard.param.detach())
        elif self.params_on_host:
            shard.working = self._updated_rows.get(shard)
            if shard.working is None:  # no CUDA device: the host rows need no page-locking
                shard.working = torch.empty(shard.spec.local_shape, dtype=shard.dtype)
            shard.working.copy_(shard.local)
        else:
            shard.working = shard.local.to(shard.dtype, copy=True)
        shard.local = master
        if shard.sharded:
            shard.to_sharded()  # stage 3: the parameter now holds the working shard

    @staticmethod
    def use_fused_kernels(optimizer: torch.optim.Optimizer) -> None:
        """Say, in one info line on rank 0, that ``optimizer`` steps with torch's fused CPU kernel where the user chose
        no implementation (see ``fused_on_host``); its ``param_groups`` stay as the user gave them."""
        if _fused_groups(optimizer):
            name = type(optimizer).__name__
            rank_zero_info(
                f"offload_optimizer: {name} steps on the host with torch's fused CPU kernel (fused=True, foreach=False "
                f"for the step only; its param_groups keep fused=None, foreach=None): give {name}(foreach=False) for "
                "DDP's single-tensor loop and its results to the bit, or fused=False"
            )

    # ----------------------------------------------------------------------------------------------------- a step

    @torch.no_grad()
    def update(
        self, sharded: ShardedOptimizer, stepped: list[ParamShard], factor: float, clip_value: float | None,
        **kwargs: Any,
    ) -> Any:
        """Steps 1-3 of [Note: one offloaded step] for the shards of ``sharded`` that have a reduced gradient."""
        groups = list(self.groups(stepped))
        arrivals = [self._fetch_grads(group) for group in groups]
        self._begin(sharded, groups)
        output = None
        pushed = []
        for index, group in enumerate(groups):
            with self.resident(index):
                for shard in group:  # edits of the parameters since the last push, into the masters now at hand
                    shard.adopt_edits()
                arrivals[index].wait()
                grads = [self._host_grad(s) for s in group]
                if factor != 1.0:
                    torch._foreach_mul_(grads, factor)
                if clip_value is not None:
                    torch._foreach_clamp_min_(grads, -clip_value)
                    torch._foreach_clamp_max_(grads, clip_value)
                with fused_on_host(sharded.optimizer):
                    output = sharded.update(list(zip(group, grads)), only=group, **kwargs)
                pushed.append(self.push(group))
        self._end()
        self.transfers.wait_on_compute(pushed)
        return output

    def groups(self, shards: list[ParamShard]) -> Iterator[list[ParamShard]]:
        """Consecutive groups of about ``group_bytes`` of parameters."""
        group: list[ParamShard] = []
        size = 0
        for shard in shards:
            group.append(shard)
            size += shard.spec.local_numel * shard.local.element_size()
            if size >= self.group_bytes:
                yield group
                group, size = [], 0
        if group:
            yield group

    def _begin(self, sharded: ShardedOptimizer, groups: list[list[ParamShard]]) -> None:
        """Before the groups of a step are walked (disk offload starts reading ahead)."""

    @contextmanager
    def resident(self, index: int) -> Iterator[None]:
        """Group ``index``'s masters and optimizer states are in host memory while inside (always, here)."""
        yield

    def _end(self) -> None:
        """After the last group (disk offload waits for the write-backs)."""

    def _fetch_grads(self, group: list[ParamShard]) -> Ticket:
        """Start copying ``group``'s gradient shards to the host (step 1; without CUDA, nothing to copy)."""
        if not self._grad_rows:
            return Ticket.DONE
        return self.transfers.copy([(self._grad_rows[s], s.grad_rows()) for s in group if self._staged_grad(s)])

    def _staged_grad(self, shard: ParamShard) -> bool:
        """Whether ``shard``'s gradient goes through the host arena: not when it is unscaled fp32 already (fp16
        loss scaling hands user hooks fp32 gradients; the arena holds the reduction's 16-bit ones)."""
        return shard.grad_rows().dtype == self._grad_rows[shard].dtype

    def _host_grad(self, shard: ParamShard) -> Tensor:
        """``shard``'s gradient in fp32 on the host, for the optimizer to consume (and the clip to scale in place):
        from its arena rows on CUDA; without CUDA a copy made from the gradient itself, one group at a time."""
        if self._grad_rows and self._staged_grad(shard):
            return self._grad_rows[shard].float()
        return shard.grad_rows().to(torch.float32, copy=True)

    def push(self, group: Sequence[ParamShard]) -> Ticket:
        """Write the masters of ``group``, cast to the working dtype, where the gathers read them (after each group's
        update, and after a checkpoint was loaded into the masters); the ticket says when the device has them."""
        pairs = []
        for shard in group:
            self._last_read.pop(shard, Ticket.DONE).wait()  # the host rows are written only once nothing reads them
            rows = self._updated_rows.get(shard)
            if rows is None or rows is shard.working:  # no device copy (no CUDA, or the host rows themselves)
                shard.working.copy_(shard.local)
            else:
                rows.copy_(shard.local)
                pairs.append((shard.working, rows))
            shard.mark_written()
        ticket = self.transfers.copy(pairs) if pairs else Ticket.DONE
        for shard, _ in pairs:
            self._last_read[shard] = ticket
        return ticket

    def refresh(self) -> None:
        """The masters were loaded (a checkpoint, ``load_state_dict``): push every shard, and make the compute
        stream wait for the rows before anything gathers them."""
        self.transfers.wait_on_compute([self.push(group) for group in self.groups(self.shards)])

    @contextmanager
    def staged(self, shards: list[ParamShard]) -> Iterator[list[Tensor] | None]:
        """Around packing ``shards`` for a unit's all-gather: the tensors to pack (``None``: each shard's
        ``gather_source``). Host rows (``offload_params``) are copied to the device by the pack, on the compute
        stream: they are not written again before that copy ran."""
        yield None
        if self.params_on_host:
            ticket = self.transfers.record()
            for shard in shards:
                self._last_read[shard] = ticket

    def grad_storage(self):
        """Where gradient shards live: in memory (``None``), here."""
        return None

    def write_master(self, shard: ParamShard, rows: Tensor) -> None:
        """Load ``rows`` (a checkpoint's) into ``shard``'s master; ``refresh`` then pushes them."""
        shard.local.copy_(rows)

    @staticmethod
    def keep_state_rows(rows: Tensor) -> Tensor:
        """Where this rank's rows of a loaded optimizer state are kept: a copy in host memory."""
        return rows.to("cpu", copy=True)

    def full_parameter(self, tensor: Tensor, device: torch.device) -> Tensor:
        """Where the end of fit keeps a full parameter just gathered into ``tensor``: on ``device``."""
        return tensor.to(device)

    def check_files(self) -> None:
        """Nothing is kept in files here."""

    def release_pages(self) -> None:
        """Nothing is kept in files here."""

    def disk_tensors(self, optimizers: list[torch.optim.Optimizer]) -> list[Tensor]:
        """Nothing is on disk here."""
        return []

    def host_buffers(self) -> list[Tensor]:
        """The pipeline's kept host buffers (the arenas; the host rows of ``offload_params`` are model state and
        counted as parameters), for memory accounting."""
        return [a.storage() for purpose, a in self.arenas.items() if purpose != "parameter shards"]

    def close(self, optimizers: tuple[torch.optim.Optimizer, ...] = ()) -> None:
        """Release the arenas (a CPU run has none), once no copy reads them."""
        for shard in self.shards:
            self._last_read.pop(shard, Ticket.DONE).wait()
        for arena in self.arenas.values():
            arena.close()
