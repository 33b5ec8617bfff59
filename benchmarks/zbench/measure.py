"""What the benchmark measures, the same way for every approach.

[Note: communication]
``CollectiveCounter.install()`` replaces the collective functions of ``torch.distributed`` (on both the package and
``distributed_c10d``) with wrappers that record, per call, the op and the size ``n`` in bytes of the full buffer it
works on (all-reduce / broadcast: the tensor; all-gather: the gathered output; reduce-scatter: the unscattered input).
Only the outermost call is recorded (``all_gather_into_tensor`` may call ``all_gather_single``). It is installed before
DDP, FSDP2, DeepSpeed or lightning_zero is imported, so every approach's Python-level collectives pass through it.
DDP's C++ reducer is routed through Python by registering torch's stock ``allreduce_hook`` (the same math).

The per-rank volume is then the ring-algorithm figure of the op that was actually issued: all-reduce
``2(N-1)/N * n``, reduce-scatter and all-gather ``(N-1)/N * n``, broadcast ``(N-1)/N * n`` (a pipelined broadcast
forwards the buffer once per non-root rank; ``N`` broadcasts of ``n/N`` each cost what an all-gather of ``n`` costs).
Tables divide it by ``(N-1)/N * Psi * 4 bytes`` so that DDP reads 2 and textbook ZeRO-3 reads 3 at any ``N``.
A point-to-point send (``isend``, ``send``) counts the bytes it sends: lightning_zero's reduce-scatter off NCCL is
one send of each other rank's segment (see lightning_zero/sharding/collectives.py), ``(N-1)/N * n`` per rank as a
ring reduce-scatter. Note that this counts what each implementation *issues*.
The bytes written to sockets (``/proc/self/io`` ``wchar``) are recorded beside it as a cross-check.

[Note: memory]
``held_tensor_bytes`` counts unique tensor storages (a view is counted once, at its storage's allocated size; a DTensor
by its local shard), in this order: parameters, gradients, optimizer states (plus master copies an optimizer holds
that are not the model's parameters), then every other tensor the Python garbage collector can reach (bucket
buffers, DeepSpeed's internal partitions, ...). ``model_state`` = params + grads + optimizer. Tensors referenced only
from C++ (autograd's saved tensors) are invisible here, which is why it is taken after backward, when the graph is
gone. Peak RSS (``ru_maxrss``) includes everything, also the interpreter and libraries; ``peak - base`` subtracts
the RSS a rank had after its imports and process-group set-up, before the model was built.
"""

from __future__ import annotations

import gc
import resource
import threading
from collections.abc import Iterable

import torch

_COLLECTIVES = {
    # name: (kind, function of (args, kwargs) -> n bytes of the full buffer)
    "all_reduce": ("all_reduce", lambda a, k: _nb(_arg(a, k, 0, "tensor"))),
    "all_reduce_coalesced": ("all_reduce", lambda a, k: sum(_nb(t) for t in _arg(a, k, 0, "tensors"))),
    "broadcast": ("broadcast", lambda a, k: _nb(_arg(a, k, 0, "tensor"))),
    "reduce": ("reduce", lambda a, k: _nb(_arg(a, k, 0, "tensor"))),
    "all_gather": ("all_gather", lambda a, k: sum(_nb(t) for t in _arg(a, k, 0, "tensor_list"))),
    "all_gather_into_tensor": ("all_gather", lambda a, k: _nb(_arg(a, k, 0, "output_tensor"))),
    "all_gather_single": ("all_gather", lambda a, k: _nb(_arg(a, k, 0, "output_tensor"))),
    "_all_gather_base": ("all_gather", lambda a, k: _nb(_arg(a, k, 0, "output_tensor"))),
    "all_gather_coalesced": (
        "all_gather",
        lambda a, k: sum(_nb(t) for ts in _arg(a, k, 0, "output_tensor_lists") for t in ts),
    ),
    "reduce_scatter": ("reduce_scatter", lambda a, k: sum(_nb(t) for t in _arg(a, k, 1, "input_list"))),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _nb(_arg(a, k, 1, "input"))),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: _nb(_arg(a, k, 1, "input"))),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, k: _nb(_arg(a, k, 1, "input"))),
    "all_to_all_single": ("all_to_all", lambda a, k: _nb(_arg(a, k, 1, "input"))),
    "all_to_all": ("all_to_all", lambda a, k: sum(_nb(t) for t in _arg(a, k, 1, "input_tensor_list"))),
    "gather": ("gather", lambda a, k: _nb(_arg(a, k, 0, "tensor"))),
    "scatter": ("scatter", lambda a, k: _nb(_arg(a, k, 0, "tensor"))),
    "send": ("p2p", lambda a, k: _nb(_arg(a, k, 0, "tensor"))),
    "isend": ("p2p", lambda a, k: _nb(_arg(a, k, 0, "tensor"))),
}

#: Per-rank ring volume of one op on a buffer of n bytes, as a multiple of (N-1)/N * n.
#: A point-to-point send counts its own bytes (what it puts on the wire).
RING_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "broadcast": 1.0, "reduce": 1.0,
               "all_to_all": 1.0, "gather": 1.0, "scatter": 1.0}


def _nb(t) -> int:
    return t.numel() * t.element_size()


def _arg(args, kwargs, i, name):
    return args[i] if len(args) > i else kwargs[name]


class CollectiveCounter:
    """Counts calls and full-buffer bytes per collective kind (see [Note: communication])."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}
        self.enabled = True
        self._local = threading.local()

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return {op: (self.calls[op], self.nbytes[op]) for op in self.calls}

    @staticmethod
    def delta(after: dict, before: dict) -> dict[str, tuple[int, int]]:
        out = {}
        for op, (calls, nbytes) in after.items():
            c0, b0 = before.get(op, (0, 0))
            if calls - c0:
                out[op] = (calls - c0, nbytes - b0)
        return out

    def _record(self, kind: str, nbytes: int) -> None:
        if self.enabled:
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.nbytes[kind] = self.nbytes.get(kind, 0) + nbytes

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, (kind, size_of) in _COLLECTIVES.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(original, kind, size_of)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)

    def _wrap(self, original, kind, size_of):
        local = self._local

        def wrapper(*args, **kwargs):
            depth = getattr(local, "depth", 0)
            if depth == 0:
                try:
                    self._record(kind, size_of(args, kwargs))
                except Exception:  # never break a run because of accounting
                    self._record(kind + "(unsized)", 0)
            local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                local.depth = depth

        wrapper.__wrapped__ = original
        wrapper.__name__ = original.__name__
        return wrapper


def ring_bytes(by_op: dict[str, tuple[int, int]], world: int) -> float:
    """Per-rank ring-algorithm bytes of the ops in ``by_op`` (see [Note: communication])."""
    if world <= 1:
        return 0.0
    total = sum(RING_FACTOR.get(op.split("(")[0], 1.0) * nbytes for op, (_, nbytes) in by_op.items() if op != "p2p")
    return total * (world - 1) / world + by_op.get("p2p", (0, 0))[1]


def wchar() -> int:
    """Bytes this process passed to write-like system calls (gloo's TCP sends among them)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRss:
    """Peak RSS over stretches of a run: Linux keeps a high-water mark (VmHWM) that writing "5" to
    /proc/self/clear_refs resets to the current RSS. ``take()`` returns the peak since the last ``take()`` (or since
    construction) and resets it. Where the reset is not permitted, it falls back to the process's lifetime peak."""

    def __init__(self) -> None:
        self.resettable = self._reset()

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _hwm() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return peak_rss()

    def take(self) -> int:
        peak = self._hwm()
        if self.resettable:
            self._reset()
        return peak


def _storage_key(t: torch.Tensor):
    try:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = t.to_local()
    except ImportError:  # pragma: no cover
        pass
    try:
        if t.device.type == "meta":
            return None
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() == 0:
            return None
        return (t.device.type, storage.data_ptr()), storage.nbytes()
    except Exception:
        return None


def label_storages(roots: dict[str, object], max_depth: int = 4) -> dict:
    """storage key -> attribute path, for tensors reachable through attributes, dicts and lists of ``roots`` (used to
    name the internal buffers of DeepSpeed's engine and optimizer). Does not descend into ``nn.Module``s."""
    labels: dict = {}
    visited: set[int] = set()

    def walk(obj, path: str, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            key = _storage_key(obj)
            if key is not None and key[0] not in labels:
                labels[key[0]] = (path, key[1])
            return
        if depth > max_depth or id(obj) in visited or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            return
        if isinstance(obj, torch.nn.Module) and depth > 0:
            return
        visited.add(id(obj))
        if isinstance(obj, dict):
            for k, v in list(obj.items())[:20000]:
                walk(v, f"{path}[{k if isinstance(k, (str, int)) else '*'}]", depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in list(obj)[:20000]:
                walk(v, f"{path}[]", depth + 1)
        elif hasattr(obj, "__dict__"):
            module = type(obj).__module__.split(".")[0]
            if depth == 0 or module in ("deepspeed", "torch", "lightning_zero"):
                for attr, v in vars(obj).items():
                    walk(v, f"{path}.{attr}", depth + 1)

    for name, obj in roots.items():
        walk(obj, name, 0)
    return labels


def _placeholder(p: torch.Tensor) -> bool:
    """A lightning_zero stage-3 parameter between its uses: its one-element placeholder is not model state (its rows
    are counted through ``extra_params``)."""
    try:
        from lightning_zero.sharding.sharded_param import is_sharded
    except ImportError:  # measuring a peer without lightning_zero installed
        return False
    return is_sharded(p)


def held_tensor_bytes(
    params: Iterable[torch.Tensor],
    optimizers: Iterable[torch.optim.Optimizer],
    extra_params: Iterable[torch.Tensor] = (),
    extra_grads: Iterable[torch.Tensor] = (),
    label_roots: dict[str, object] | None = None,
    extra_optim: Iterable[torch.Tensor] = (),
) -> dict:
    """Bytes of unique storages by kind (see [Note: memory]). ``extra_params``: parameter storage not reachable as a
    module parameter (DeepSpeed ZeRO-3's ``ds_tensor`` partitions, lightning_zero stage 3's local shards);
    ``extra_grads``: gradient storage held outside ``.grad`` (lightning_zero's shard buffers); ``extra_optim``:
    optimizer state held outside the optimizer (lightning_zero's fp32 master shards)."""
    seen: set = set()
    cats = {"params": 0, "grads": 0, "optim": 0, "other": 0}
    detail: dict[str, int] = {}

    def add(t, cat: str) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        key = _storage_key(t)
        if key is None or key[0] in seen:
            return False
        seen.add(key[0])
        cats[cat] += key[1]
        return True

    params = list(params)
    optimizers = list(optimizers)
    for p in params:
        if not _placeholder(p):
            add(p, "params")
    for p in extra_params:
        add(p, "params")
    for p in params:
        add(p.grad, "grads")
    for t in extra_grads:
        add(t, "grads")
    for t in extra_optim:
        add(t, "optim")
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if not _placeholder(p):
                    add(p, "optim")  # a master copy the optimizer holds beside the model's parameters
                add(p.grad, "grads")
        for state in opt.state.values():
            if isinstance(state, dict):
                for v in state.values():
                    add(v, "optim")
    if label_roots:
        for key, (path, nbytes) in label_storages(label_roots).items():
            if key in seen:
                continue
            seen.add(key)
            last = path.split(".")[-1].lower()
            cat = "grads" if "grad" in last else "optim" if "fp32" in last or "optim" in last else "other"
            cats[cat] += nbytes
            short = path.replace("_DeepSpeedZeroOptimizer_Stage3__", "").replace("_DeepSpeedZeroOptimizer__", "")
            detail[f"{cat}:{short}"] = detail.get(f"{cat}:{short}", 0) + nbytes
    gc.collect()
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and add(obj, "other"):
                pass
        except Exception:
            pass
    cats["model_state"] = cats["params"] + cats["grads"] + cats["optim"]
    cats["total"] = cats["model_state"] + cats["other"]
    cats["detail"] = {k: v for k, v in sorted(detail.items(), key=lambda kv: -kv[1]) if v >= 1 << 18}
    return cats


class PhaseTimers:
    """Wall time spent inside chosen functions, per step: each ``"module:Qual.name"`` is wrapped in place (class
    attribute or module function) by a timer that counts only its outermost call. Used for profiling
    (``compare.py --timers``): it changes nothing but adds ~1 us per call."""

    def __init__(self, names: list[str]) -> None:
        import importlib

        self.totals: dict[str, float] = {n: 0.0 for n in names}
        self.calls: dict[str, int] = {n: 0 for n in names}
        for name in names:
            module_name, _, qual = name.partition(":")
            owner = importlib.import_module(module_name)
            *path, attr = qual.split(".")
            for part in path:
                owner = getattr(owner, part)
            original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            setattr(owner, attr, self._wrap(name, original))

    def _wrap(self, name: str, original):
        import functools
        import time

        totals, calls, active = self.totals, self.calls, {}
        if isinstance(original, (staticmethod, classmethod)):
            raise TypeError(f"{name}: static/class methods are not supported")

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if active.get(threading.get_ident()):
                return original(*args, **kwargs)
            active[threading.get_ident()] = True
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - t
                calls[name] += 1
                active[threading.get_ident()] = False

        return wrapper

    def snapshot(self) -> dict[str, tuple[float, int]]:
        return {n: (self.totals[n], self.calls[n]) for n in self.totals}
