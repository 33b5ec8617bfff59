"""What user code sees of a parameter and its gradient, and when what it writes is taken back: the one owner of that
contract. ``ZeroRuntime`` calls it at every point where control passes between user code and the sharded state.

[Note: what user code sees of a parameter and its gradient]
DDP is the reference: a LightningModule, its callbacks and the user's own code read and write ``p``, ``p.data`` and
``p.grad`` in any hook, and the result must be DDP's, or one error before any state changed. Two facts make that
hard under ZeRO: the values that are stepped live in shards (fp32 masters under mixed precision, on the host or on
disk when offloaded), and the averaged gradient exists only as each rank's rows. So there is one rule per object:

* **Parameters** are the user's. Under stages 1-2 every rank holds the full parameter between steps; under stage 3 a
  parameter holds its values only inside its unit's forward and backward and inside
  ``trainer.strategy.gathered_parameters()`` (elsewhere reading or writing its values raises, naming that way out:
  sharded_param.py), and between its uses ``p.data`` and ``p.detach()`` give this rank's rows of them, answering as the
  full tensor would ([Note: a parameter's values between its uses] in sharded_param.py: what Lightning's EMA and SWA
  callbacks and ``state_dict()`` use); what is written into those rows is written into the masters. Whatever user code
  writes into a parameter that holds values is taken back into the shards before the runtime next reads them: before
  every optimizer step, before a checkpoint is saved, at the end of fit (the module gets the masters then), when
  ``gathered_parameters()`` ends, after ``load_state_dict``. Three kinds of write are detected
  (``ParamShard.adopt_edits``): a rebinding of ``.data`` (its pointer; ``ModelPruning``'s lottery-ticket reset: the
  parameter then aliases the new tensor, as under DDP, and takes its dtype, or under stage 3 the master aliases its rows
  and the parameter keeps its dtype), an in-place edit autograd's version counter sees, and a write through ``.data``,
  which moves no version counter and is found by comparing the values with what the runtime last wrote, element by
  element and without a host synchronisation (``EMAWeightAveraging``'s copy of the average at ``on_train_end``). Under
  mixed precision a masters' element takes the new 16-bit value where the user changed it and keeps its fp32 value
  elsewhere. A rebinding is also taken back when the next training step begins, so that the forward runs on the shards'
  dtype and values.
* **Gradients** are handed to user code once they are complete: every reduction of a backward is finished before
  ``on_after_backward`` runs (``ZeroStrategy.backward``), and under fp16 loss scaling they are unscaled (into fp32)
  before ``on_before_optimizer_step``, as Lightning's AMP plugin unscales for DDP. ``p.grad`` is then a
  ``ShardedGrad`` (sharded_grad.py, [Note: a sharded gradient answers as the full one]): norms, clipping and
  element-wise edits give DDP's result, reads that would need other ranks' values raise naming
  ``trainer.strategy.gathered_gradients()``. The step takes back whatever ``p.grad`` holds then
  (``ParamShard.grad_rows``): an edited shard, a full tensor the user assigned, or ``None`` (not stepped, as a torch
  optimizer skips it). Gradient accumulation: between optimizer steps stage 1 shows the local full gradients, as
  DDP's ``no_sync``; stages 2 and 3 show the averaged sum so far.
* **What is not covered** (the README names it): a write through ``.data`` inside a stage-3 unit's forward (during
  the step a unit's parameters are taken back only when autograd's version counter moved), and a ``.data``
  rebinding of a stage-3 parameter to a tensor of another dtype (its rows are cast to the shard's dtype).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn

from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.buckets import make_buckets
from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.in_flight import BufferPool, gather_bucket
from lightning_zero.sharding.joined_reads import JoinedReads
from lightning_zero.sharding import sharded_grad_ops  # noqa: F401  (registers what a ShardedGrad answers)
from lightning_zero.sharding.sharded_grad import RowLayout, ShardedGrad, ShardedRows
from lightning_zero.sharding.sharded_param import ShardedValues, answer_values


def row_layout(shard: ParamShard) -> RowLayout:
    """The rows of ``shard``'s parameter this rank holds (a 0-d parameter is one row)."""
    lo, hi = shard.spec.owned_rows()
    return RowLayout(shard.spec.shape, lo, hi, single=len(shard.spec.shape) == 0)


class UserView:
    """The owner of what user code sees of ``shards``' parameters and gradients (see [Note: what user code sees of a
    parameter and its gradient]): takes back what it wrote into parameters, hands the reduced gradient shards out as
    ``ShardedGrad`` and answers their reductions over the ranks that hold the other rows (``comms``: the shard
    group). The runtime calls it wherever control passes between user code and the shards."""

    def __init__(self, comms: Collectives, shards: Sequence[ParamShard]) -> None:
        self.comms = comms
        self.shards = list(shards)
        #: Where a read that needs a collective waits for every rank to run it (``None``: one rank, or no check; the
        #: strategy sets it at setup).
        self.reads: JoinedReads | None = None
        self._position = {shard: i for i, shard in enumerate(shards)}
        #: The gradients handed out since the last backward began, by their shard's position (the same on every rank).
        self._handed: dict[int, ShardedGrad] = {}
        #: The 2- and inf-norms of the whole gradients handed out, by ord, kept until a gradient changes.
        self._norms: dict[float, dict[int, Tensor]] = {}
        #: Whether ``complete`` takes them: where user code can see the gradients (the strategy decides at setup).
        self.keep_norms = True
        self._shard_of = {shard.param: shard for shard in self.shards}
        #: Whether user code wrote a stage-3 parameter's masters through its values since ``take_written`` (an
        #: offload then pushes them where the gathers read them).
        self._masters_written = False
        self._values_owner = _ValuesOwner(self, written=True)
        self._copies_owner = _ValuesOwner(self, written=False)
        for shard in self.shards:
            answer_values(shard.param, self)

    # ------------------------------------------------------------------------------------------------ parameters

    def take_back(self, compare: bool = True) -> None:
        """What user code wrote into the parameters since the shards last wrote them goes into the shards
        (``ParamShard.adopt_edits``; under mixed precision the fp32 masters take it). ``compare=False``: rebindings
        and version-counted edits only (an offloaded step compares values where it holds the masters)."""
        for shard in self.shards:
            shard.adopt_edits(compare)

    def values(self, param: nn.Parameter) -> ShardedValues | None:
        """``param.data`` or ``param.detach()`` of a sharded stage-3 parameter: this rank's rows of its values (see
        [Note: a parameter's values between its uses] in sharded_param.py)."""
        shard = self._shard_of.get(param)
        if shard is None or not shard.sharded:
            return None
        layout = row_layout(shard)
        return ShardedValues(shard.local.view(layout.local_shape), layout, self._values_owner, shard.name)

    def take_rows(self, param: nn.Parameter, values: ShardedRows) -> None:
        """``param.data = values`` (a ``ShardedValues`` of the same layout): the parameter's rows become ``values``'
        rows (``ParamShard.take_rows``)."""
        shard = self._shard_of[param]
        if values._layout != row_layout(shard):
            raise values.refusal(f"assigning it to the `.data` of {shard.name!r}, which is sharded otherwise")
        shard.take_rows(values._local)
        self._masters_written = True

    def take_written(self) -> bool:
        """Whether stage-3 masters were written through their values since the last call."""
        written, self._masters_written = self._masters_written, False
        return written

    @torch.no_grad()
    def shard_copy(self, copy: nn.Module, originals: Iterable[nn.Parameter],
                   keep_rows: Callable[[Tensor], Tensor] = Tensor.clone) -> int:
        """A copy of the module made before it was sharded (a weight-averaging callback's average) keeps only this
        rank's rows: each parameter of ``copy``, paired with the module's parameter at the same position (as the
        callbacks pair them), becomes a ``ShardedValues`` of its rows, in its own dtype, kept by ``keep_rows`` (a
        copy where it is; where an offload keeps optimizer states), and the full tensor is freed (a copy on the meta
        device takes the module's rows). Returns the bytes the copy's parameters hold now."""
        replaced: dict[int, nn.Parameter] = {}
        for mine, original in zip(copy.parameters(), originals):
            shard = self._shard_of.get(original)
            if shard is None or not shard.sharded or isinstance(mine, ShardedRows) or id(mine) in replaced:
                continue
            if mine.shape != shard.spec.shape:
                raise ValueError(f"the copy's parameter paired with {shard.name!r} has shape {tuple(mine.shape)}, "
                                 f"the module's {tuple(shard.spec.shape)}: copies must be made of the same module")
            layout = row_layout(shard)
            # a copy of a module built on the meta device has no values: it starts from the module's (SWA's copies)
            source = shard.local.to(mine.dtype) if mine.is_meta else shard.spec.local_view(mine.detach())
            rows = keep_rows(source).view(layout.local_shape)
            values = ShardedValues(rows, layout, self._copies_owner, shard.name)
            replaced[id(mine)] = nn.Parameter(values, mine.requires_grad)
        for module in copy.modules():
            for name, param in module._parameters.items():
                if param is not None and id(param) in replaced:
                    module._parameters[name] = replaced[id(param)]
        return sum(p._local.nbytes if isinstance(p, ShardedRows) else p.nbytes for p in copy.parameters())

    def rebound(self) -> list[ParamShard]:
        """The parameters whose ``.data`` user code replaced (``ModelPruning``'s reset): a pointer comparison each."""
        with torch._C.DisableTorchFunctionSubclass():  # a sharded stage-3 parameter's class answers metadata slowly
            return [s for s in self.shards if s.param.data_ptr() != s.written_ptr and not s.released]

    # ------------------------------------------------------------------------------------------------- gradients

    def hand_out(self, shard: ParamShard, rows: Tensor) -> ShardedGrad:
        """``rows`` (this rank's averaged gradient rows of ``shard``) as the gradient user code sees."""
        layout = row_layout(shard)
        key = self._position[shard]
        grad = ShardedGrad(rows.view(layout.local_shape), layout, self, shard.name, key)
        self._handed[key] = grad
        self.changed()
        return grad

    def begin_backward(self) -> None:
        """A backward starts: what was handed out is taken back (or was dropped by ``zero_grad``)."""
        self._handed.clear()
        self.changed()

    def changed(self, key: int | None = None, factor: Tensor | float | None = None) -> None:
        """A gradient handed out was written: the whole gradient ``key`` multiplied by ``factor`` (its kept norms
        follow), or anything (they are dropped)."""
        if key is None or factor is None:
            self._norms.clear()
        else:
            self._scale_kept(factor, key)

    def stop_reads(self) -> None:
        """No more joined reads (end of fit: the watchdog that publishes the ranks' counts stops)."""
        self.reads = None

    def join(self, what: str, of: ShardedRows | None = None, gradients: bool = True) -> None:
        """Before a collective that user code's read ``what`` issues: wait until every rank runs it, or raise
        ``OneRankReadError`` (see [Note: a read that runs on one rank] in joined_reads.py). ``of``: the tensor read
        (else ``gradients`` says which way out to name)."""
        if self.reads is None or self.comms.local:
            return
        if of is not None:
            gradients = isinstance(of, ShardedGrad)
            what = f"{what} on {'the gradient of' if gradients else 'the values of zero3 parameter'} {of._name!r}"
        self.reads.join(what, _GRADIENTS_WAY_OUT if gradients else _VALUES_WAY_OUT, self.comms.links.members)

    def all_reduce(self, tensor: Tensor, op: str, of: ShardedRows, call: str) -> Tensor:
        """``tensor`` (``of``'s partial result of the reduction ``call``) reduced across the ranks holding the other
        rows, once every rank runs it."""
        self.join(call, of)
        work = tensor.to(self.comms.device)
        self.comms.all_reduce_(work, "a reduction of a sharded gradient", op=op)
        return work.to(tensor.device)

    @torch.no_grad()
    def complete(self) -> None:
        """Every rank, once the gradients handed out are complete (after a backward's reductions, after fp16
        unscaling): the norms that user code on one rank may read (``p.grad.norm()``, ``p.grad.abs().max()``) are
        taken now, together, so that such a read needs no collective."""
        self.changed()
        if self._handed and self.keep_norms:
            for ord in (2.0, math.inf):
                self._norms[ord] = self._whole_norms(ord)

    def scaled(self, factor: Tensor | float, clamped: bool) -> None:
        """The step scaled every gradient handed out by ``factor`` (clipping, unscaling) and, if ``clamped``, clamped
        them: the norms kept follow (a clamp drops them)."""
        if clamped:
            self.changed()
        else:
            self._scale_kept(factor)

    def _scale_kept(self, factor: Tensor | float, key: int | None = None) -> None:
        """The kept norms of gradient ``key`` (default: every one) times ``|factor|``."""
        factor = torch.as_tensor(factor, dtype=torch.float32, device=self.comms.device).abs()
        for ord, norms in self._norms.items():
            if key is None and norms:
                self._norms[ord] = dict(zip(norms, (torch.stack(list(norms.values())) * factor).unbind()))
            elif key in norms:
                norms[key] = norms[key] * factor

    def whole_norms(self, ord: float) -> dict[int, Tensor]:
        """The ``ord``-norm (2 or inf) of every whole gradient handed out, by key: kept since the gradients were
        complete, or, after user code changed one, computed together (a read every rank must join)."""
        if ord not in self._norms:
            self.join(f"{'the 2-norm' if ord == 2.0 else 'the largest magnitude'} of a gradient (one rank alone "
                      "reads it where it is kept: where the LightningModule or a callback of yours overrides "
                      "on_after_backward, on_before_optimizer_step or on_before_zero_grad, from the backward to the "
                      "first edit that is not a scalar factor)")
            self._norms[ord] = self._whole_norms(ord)
        return self._norms[ord]

    def _whole_norms(self, ord: float) -> dict[int, Tensor]:
        """One all-reduce of every handed-out gradient's partial ``ord``-norm (every rank calls it)."""
        keys = sorted(self._handed)
        locals_ = [self._handed[k]._local for k in keys]
        stacked = torch.zeros(len(keys), dtype=torch.float32, device=self.comms.device)
        for dtype in dict.fromkeys(t.dtype for t in locals_):  # one foreach kernel per dtype
            where = [i for i, t in enumerate(locals_) if t.dtype == dtype and t.numel()]  # a rank without rows: 0
            if not where:
                continue
            tensors = [locals_[i] for i in where]
            wide = torch.float64 if dtype == torch.float64 else torch.float32  # norm_'s dtype never narrows
            norms = _largest_magnitudes(tensors) if ord == math.inf else torch._foreach_norm(tensors, ord, dtype=wide)
            stacked[where] = torch.stack(norms).float().to(stacked.device)
        if ord == 2.0:
            stacked.square_()
        self.comms.all_reduce_(stacked, "the gradient norms", op="sum" if ord == 2.0 else "max",
                               counted_as="gradient_norms")
        values = stacked.sqrt() if ord == 2.0 else stacked
        return dict(zip(keys, values.unbind()))

    @torch.no_grad()
    def grad_norms(self, norm_type: float, group_separator: str) -> dict[str, float]:
        """What Lightning's ``grad_norm(module, norm_type)`` returns under DDP: the norm of each parameter's whole
        gradient and their total; the 2- and inf-norms of gradients as handed out are answered with no collective,
        others with one all-reduce every rank must join."""
        norm_type = float(norm_type)
        with_grads = [s for s in self.shards if s.param.grad is not None]
        keys = [self._position[s] for s in with_grads]
        kept = self._norms.get(norm_type, {})
        if all(isinstance(s.param.grad, ShardedGrad) and k in kept for s, k in zip(with_grads, keys)):
            norms = torch.stack([kept[k] for k in keys]) if keys else torch.zeros(0)
        else:
            rows = [s.grad_rows() for s in with_grads]
            if norm_type == math.inf:
                parts = [g.abs().max().float() if g.numel() else g.new_zeros((), dtype=torch.float32) for g in rows]
            else:
                parts = [g.float().abs().pow(norm_type).sum() for g in rows]
            stacked = torch.stack(parts).to(self.comms.device) if parts else torch.zeros(0, device=self.comms.device)
            self.join(f"trainer.strategy.grad_norm({norm_type:g})")
            self.comms.all_reduce_(stacked, "the gradient norms", op="max" if norm_type == math.inf else "sum")
            norms = stacked if norm_type == math.inf else stacked.pow(1.0 / norm_type)
        values = norms.tolist()
        out = {f"grad_{norm_type}_norm{group_separator}{s.name}": v for s, v in zip(with_grads, values)}
        if values:
            total = max(values) if norm_type == math.inf else float(norms.pow(norm_type).sum().pow(1 / norm_type))
            out[f"grad_{norm_type}_norm_total"] = total
        return out

    @torch.no_grad()
    def unscale(self, grads: Sequence[tuple[ParamShard, Tensor]], scaler) -> None:
        """fp16 loss scaling, before ``on_before_optimizer_step``: ``grads`` (the step's fp32 gradients: copies of
        the 16-bit ones) unscaled and handed out, as Lightning's AMP plugin hands user code unscaled gradients."""
        inv_scale = 1.0 / scaler.get_scale()
        for shard, grad in grads:
            grad.mul_(inv_scale)
            shard.set_grad_shard(self.hand_out(shard, grad))
        self.complete()

    @contextmanager
    def gathered_gradients(self) -> Iterator[None]:
        """Plain full gradients in ``p.grad`` while inside (one all-gather of every gradient shard); what user code
        leaves there is taken back on exit (edits made in place or a new full tensor). Every rank must enter it
        (joined: see [Note: a read that runs on one rank] in joined_reads.py)."""
        self.join("trainer.strategy.gathered_gradients()")
        with_grads = [s for s in self.shards if isinstance(s.param.grad, ShardedGrad)]
        shown = {s: s.param.grad for s in with_grads}
        fulls = {s: torch.empty(s.spec.shape, dtype=shown[s].dtype, device=shown[s].device) for s in with_grads}
        pool = BufferPool(self.comms.device, limit=0)
        for dtype in dict.fromkeys(shown[s].dtype for s in with_grads):  # model order: the same on every rank
            group = [s for s in with_grads if shown[s].dtype == dtype]
            for bucket in make_buckets(group, 1 << 62, dtype):
                sources = [shown[s]._local for s in bucket.shards]
                targets = [fulls[s] for s in bucket.shards]
                gather_bucket(self.comms, pool, bucket, sources).complete(partial(bucket.unpack, tensors=targets))
        for shard in with_grads:
            shard.set_grad_shard(fulls[shard])
        try:
            yield
        finally:
            for shard in with_grads:
                left = shard.param.grad
                if left is not None and left.shape == shard.spec.shape:
                    shown[shard]._local.copy_(shard.spec.local_view(left).view(shown[shard]._local.shape))
                shard.set_grad_shard(shown[shard] if left is not None else None)
            self.changed()


class _ValuesOwner:
    """What the ``ShardedValues`` of parameters (``written``: the module's own, whose writes go into the masters) or
    of a copy of the module answer reductions with and tell writes to."""

    def __init__(self, view: UserView, written: bool) -> None:
        self._view = view
        self._written = written

    def all_reduce(self, tensor: Tensor, op: str, of: ShardedRows, call: str) -> Tensor:
        return self._view.all_reduce(tensor, op, of, call)

    def changed(self, key: int | None = None, factor: Tensor | float | None = None) -> None:
        if self._written:
            self._view._masters_written = True

    def whole_norms(self, ord: float) -> dict[int, Tensor]:
        return {}


def _largest_magnitudes(tensors: list[Tensor]) -> list[Tensor]:
    """Each tensor's largest magnitude (a NaN if it holds one). One multi-tensor kernel on CUDA; on the CPU the
    inf-norm kernels are not vectorized (30 ms against 2.6 for ``aminmax`` over 10.7M fp32 elements, one thread), so
    each tensor's extremes are taken in one pass instead."""
    if tensors[0].device.type == "cuda":
        return list(torch._foreach_norm(tensors, math.inf))
    return [torch.maximum(high, -low) for low, high in map(torch.aminmax, tensors)]


_GRADIENTS_WAY_OUT = (
    "Run it on every rank, or read full gradients inside `with trainer.strategy.gathered_gradients():` entered by "
    "every rank; `p.grad.norm()` and `p.grad.abs().max()` are answered on any rank alone")
_VALUES_WAY_OUT = (
    "Run it on every rank, or read full parameters inside `with trainer.strategy.gathered_parameters():` entered by "
    "every rank, or use strategy='zero2', which keeps full parameters on every rank")
