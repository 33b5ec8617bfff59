"""Large-model init for stage 3: turn a module built on the meta device into local shards, one module at a time.

[Note: initial values of a model built on the meta device]
Under ``configure_model()`` (and ``Trainer.init_module()``) a stage-3 strategy builds the model on the meta device,
where nothing is allocated and no random numbers are drawn, and records at that moment the state of the generator
that initializes tensors on the training device (the CPU's, or the CUDA device's, as an eager build there would use;
in a process that has not initialized CUDA, the seed that determines it: see [Note: the CUDA generator of a process
without CUDA]).
Setup then materializes the model unit by unit, starting from that RNG state: a unit's meta parameters and buffers
are allocated in full, its initializers run, the local rows of each parameter are copied out and the full storage is
freed before the next unit. A unit is one module, except that a module whose own initializer may reach into its
children (one with an initializer and children also on the meta device, such as ``nn.MultiheadAttention`` or
``nn.Transformer``) comes with its whole subtree; no rank ever holds more than the largest unit in full.

A module's initializers are, in this order: its own, torch.nn's ``reset_parameters()`` (or the private
``_reset_parameters()`` of ``nn.MultiheadAttention`` and ``nn.Transformer``), or a rotary embedding's
``rope_init_fn`` (transformers 4.x); then, inside a Hugging Face model, that model's ``_init_weights(module)``, as
its ``post_init()`` does after construction. Units are visited children first, and a unit's initializers run its
modules children first: an eager build runs a module's initializer at the end of its ``__init__``, after building
its children. Every rank draws the same numbers, and they are the numbers an eager build from the same seed draws
when each module draws its initial values in its initializer and modules are built in the order they are registered:
for torch.nn's layers and models composed of them the values are equal, bit for bit. Two known exceptions:
``nn.TransformerEncoder``/``Decoder`` deep-copy one layer, so eagerly all their layers start equal, while here each
is initialized on its own; and a Hugging Face model, which eagerly draws torch's defaults for every module before
``_init_weights`` runs over the whole model, here gets both module by module, so its random values differ from an
eager build's while following the same distributions (its deterministic values, norms, zero biases and rotary
frequencies, are equal). A weight tied to another (``lm_head.weight = wte.weight``) keeps the values of the module
that registered it first; the later module's initializers run on a scratch tensor of the full shape, so that the
random stream advances as in the eager build.

[Note: the CUDA generator of a process without CUDA]
Reading a CUDA generator's state initializes CUDA, and the process that launches the ranks must not initialize it:
Lightning cannot fork ranks from a process that has (``zero3_fork``, ``zero3_notebook``), and ``Trainer.init_module()``
runs in that process. Nor does it need to: a CUDA generator in a process that has not initialized CUDA has drawn
nothing, so its state is the seed it will start from, with offset 0. torch seeds it lazily, with the seed the CPU's
generator gets: ``torch.manual_seed`` and ``torch.seed`` (and Lightning's ``seed_everything``, which calls the
former) give the CPU's generator a seed and queue the same one for every CUDA device. So the seed recorded is
``torch.initial_seed()``, and setup, in the rank, makes the state of a CUDA generator seeded with it: the state an
eager build in the launching process would have drawn from. Not seen: a seed given to the CUDA generators alone
(``torch.cuda.manual_seed``) after the CPU's; and with no seed at all, when torch starts each generator from a seed
of its own drawn at random, the model draws from the CPU's seed (still the same numbers on every rank).

A tensor is never left holding uninitialized memory: each is allocated filled with a value no initializer writes
(NaN, or for integers and booleans a bit pattern they never hold in practice) and checked once its unit's
initializers ran. A value computed in ``__init__`` (a buffer such as ``torch.arange(4.0) / 4``, a causal mask) that
no initializer recomputes is thus reported by module and name instead of training on garbage; so is a parameter an
initializer forgets. (Tracking writes instead would miss ``.data`` writes, which bypass version counters, or need a
dispatch mode around every initializer; the sentinel costs one fill and one reduction per tensor.) Modules that own
meta tensors but have no initializer at all are reported together before anything is allocated, and so is a Hugging
Face model built from the config of a local checkpoint, whose weights would silently become random ones; when an
initializer fails or leaves a tensor unwritten, every module materialized so far is put back on the meta device.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_zero.sharding.flat_param import ShardSpec

#: What an initializer is called in error messages, and the call itself.
Initializer = tuple[str, Callable[[], object]]


def rng_state(device: torch.device) -> Tensor | int:
    """The state of the generator that initializes tensors on ``device`` (the CPU's, or that CUDA device's); for a
    CUDA device in a process that has not initialized CUDA, the seed that generator starts from, read without
    initializing CUDA (see [Note: the CUDA generator of a process without CUDA]). ``generator_state`` makes either
    into a state."""
    if device.type != "cuda":
        return torch.random.get_rng_state()
    return torch.cuda.get_rng_state(device) if torch.cuda.is_initialized() else torch.initial_seed()


def generator_state(device: torch.device, recorded: Tensor | int) -> Tensor:
    """The state of ``device``'s generator that ``rng_state`` recorded: a seed becomes the state of a generator of
    ``device`` seeded with it (which, for a CUDA device, initializes CUDA: a rank's work, in setup)."""
    if isinstance(recorded, Tensor):
        return recorded
    return torch.Generator(device).manual_seed(recorded).get_state()


def _set_rng_state(device: torch.device, state: Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.random.set_rng_state(state)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def materialize_shards(
    root: nn.Module, device: torch.device, generator_state: Tensor | None, rank: int, world_size: int,
    loaded: dict[Tensor, Tensor] | None = None,
) -> dict[nn.Parameter, tuple[torch.Size, Tensor]]:
    """Replace every meta parameter and buffer of ``root`` by a real one on ``device``.

    Parameters come back empty (the stage-3 sharded state); the returned dict maps each of them to its full shape
    and its local rows. ``loaded``: values ``load_state_dict`` gave meta tensors (``LoadsOnMeta``), which replace
    their initial values. On failure ``root`` is left on the meta device. See [Note: initial values of a model built
    on the meta device].
    """
    names = {m: n for n, m in root.named_modules()}
    units = _plan(root)
    loaded = loaded or {}
    _check_initializable([unit for unit in units if not _all_loaded([unit], loaded)], names)
    if not _all_loaded(units, loaded):
        _check_no_checkpoint_is_dropped(root, names)
    if generator_state is not None:
        _set_rng_state(device, generator_state)
    materializer = _Materializer(device, names, loaded)
    local_rows: dict[nn.Parameter, tuple[torch.Size, Tensor]] = {}
    try:
        for unit in units:
            for param in materializer.materialize(unit):
                spec = ShardSpec(param.shape, rank, world_size)
                local_rows[param] = (param.shape, spec.local_view(param.detach()).clone())
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    except BaseException:
        materializer.undo()
        raise
    return local_rows


def _all_loaded(units: list[_Unit], loaded: dict[Tensor, Tensor]) -> bool:
    return all(t in loaded for unit in units for m in unit.modules for t in _own_meta_tensors(m))


class LoadsOnMeta:
    """``load_state_dict`` on a model built on the meta device (under ``Trainer.init_module()``), whose values torch
    would drop (a copy into a meta tensor does nothing): each module built while ``watching`` gets a load pre-hook
    that keeps, per meta parameter and buffer, the value the state dict gives it (a reference, not a copy), and
    setup materializes from those values instead of the initializers' (``materialize_shards(loaded=...)``), as DDP
    keeps what ``load_state_dict`` loaded into an ``empty_init`` model."""

    def __init__(self) -> None:
        self.values: dict[Tensor, Tensor] = {}
        self._hooked: dict[nn.Module, object] = {}

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Hook every module that gets a submodule, parameter or buffer while inside."""
        register = torch.nn.modules.module
        handles = [
            register.register_module_module_registration_hook(lambda module, _name, child: self._hook(module, child)),
            register.register_module_parameter_registration_hook(lambda module, _name, _p: self._hook(module)),
            register.register_module_buffer_registration_hook(lambda module, _name, _b: self._hook(module)),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, *modules: nn.Module | None) -> None:
        for module in modules:
            if isinstance(module, nn.Module) and module not in self._hooked:
                self._hooked[module] = module._register_load_state_dict_pre_hook(self._keep, with_module=True)

    @torch.no_grad()
    def _keep(self, module: nn.Module, state_dict, prefix, *_args) -> None:
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            value = state_dict.get(prefix + name)
            if tensor is not None and tensor.is_meta and torch.is_tensor(value) and value.shape == tensor.shape:
                self.values[tensor] = value

    def __getstate__(self) -> dict:  # pickled with the Trainer for spawned ranks: the values go, the hooks stay
        return {"values": self.values, "_hooked": {}}

    def release(self) -> None:
        """Remove the hooks and forget the values (setup has materialized from them)."""
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        self.values = {}


def _own_meta_tensors(module: nn.Module) -> list[Tensor]:
    return [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None and t.is_meta]


# ------------------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class _Unit:
    """Modules allocated, initialized and sharded together, children first; ``steps`` run in order."""

    modules: list[nn.Module]
    steps: list[tuple[nn.Module, Initializer]]


def _plan(root: nn.Module) -> list[_Unit]:
    """The units of ``root`` that own meta tensors, children before their parent."""
    owners = _hugging_face_owners(root)
    units: list[_Unit] = []
    seen: set[nn.Module] = set()

    def subtree(module: nn.Module) -> list[nn.Module]:
        if module in seen:
            return []
        seen.add(module)
        return [m for child in module.children() for m in subtree(child)] + [module]

    def visit(module: nn.Module) -> None:
        if module in seen:
            return
        if _own_initializer(module) is not None and any(has_meta_tensors(c) for c in module.children()):
            modules = subtree(module)
            units.append(_Unit(modules, _steps(modules, owners)))
            return
        seen.add(module)
        for child in module.children():
            visit(child)
        units.append(_Unit([module], _steps([module], owners)))

    visit(root)
    return [unit for unit in units if any(_owns_meta_tensors(m) for m in unit.modules)]


def _steps(modules: list[nn.Module], owners: dict[nn.Module, nn.Module]) -> list[tuple[nn.Module, Initializer]]:
    """The modules' own initializers, then their Hugging Face model's (construction, then ``post_init``)."""
    own = [(m, init) for m in modules if (init := _own_initializer(m)) is not None]
    hugging_face = [(m, _hugging_face_initializer(owners[m], m)) for m in modules if m in owners]
    return own + hugging_face


def _own_initializer(module: nn.Module) -> Initializer | None:
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return f"{type(module).__name__}.{name}()", method
    if callable(getattr(module, "rope_init_fn", None)) and "inv_freq" in module._buffers:
        return f"{type(module).__name__}.rope_init_fn()", partial(_recompute_inv_freq, module)
    return None


def _recompute_inv_freq(rotary: nn.Module) -> None:
    """A transformers 4.x rotary embedding computes ``inv_freq`` in ``__init__`` with its ``rope_init_fn``, which its
    model's ``_init_weights`` does not call again (transformers 5 does)."""
    inv_freq, _ = rotary.rope_init_fn(rotary.config, rotary.inv_freq.device, **getattr(rotary, "rope_kwargs", {}))
    rotary.inv_freq.copy_(inv_freq)
    if "original_inv_freq" in rotary._buffers:
        rotary.original_inv_freq.copy_(inv_freq)
    else:  # 4.x keeps it as a plain attribute aliasing the buffer, to restore it from
        rotary.original_inv_freq = rotary.inv_freq


def _hugging_face_owners(root: nn.Module) -> dict[nn.Module, nn.Module]:
    """Each module inside a Hugging Face model, mapped to the innermost ``PreTrainedModel`` holding it (as
    ``PreTrainedModel.initialize_weights`` dispatches)."""
    # Never imports transformers (some libraries import part of it, and all of it is slow and large): a Hugging Face
    # model exists only once its modeling_utils did.
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    owners: dict[nn.Module, nn.Module] = {}

    def visit(module: nn.Module, owner: nn.Module | None) -> None:
        owner = module if pretrained is not None and isinstance(module, pretrained) else owner
        if owner is not None:
            owners[module] = owner
        for child in module.children():
            visit(child, owner)

    visit(root, None)
    return owners


def _hugging_face_initializer(owner: nn.Module, module: nn.Module) -> Initializer:
    return f"{type(owner).__name__}._init_weights()", partial(owner._init_weights, module)


def _owns_meta_tensors(module: nn.Module) -> bool:
    return any(t is not None and t.is_meta for t in [*module._parameters.values(), *module._buffers.values()])


def _check_initializable(units: list[_Unit], names: dict[nn.Module, str]) -> None:
    lost = [unit.modules[0] for unit in units if not unit.steps]
    if lost:
        owned = "; ".join(f"{_describe(m, names)} owns {_meta_tensor_names(m)}" for m in lost)
        raise RuntimeError(
            f"these modules were built on the meta device but have no reset_parameters() to initialize them: "
            f"{owned}. Define reset_parameters() to initialize all their parameters and buffers, or build them in "
            "__init__ instead of configure_model()"
        )


def _check_no_checkpoint_is_dropped(root: nn.Module, names: dict[nn.Module, str]) -> None:
    """A Hugging Face model built on the meta device from a local checkpoint's config would get random weights here,
    not the checkpoint's."""
    for model in dict.fromkeys(_hugging_face_owners(root).values()):  # outermost first
        source = Path(getattr(model, "name_or_path", "") or "")
        if has_meta_tensors(model) and source.is_dir() and any(source.glob("*.safetensors")):
            raise RuntimeError(
                f"{_describe(model, names)} was built on the meta device from the config of the checkpoint "
                f"'{source}', whose weights stage-3 init does not load: it would train from random weights. "
                "Fine-tune it with stage 1 or 2, or build it in __init__ instead of configure_model()"
            )


def _meta_tensor_names(module: nn.Module) -> list[str]:
    return [n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None and t.is_meta]


def _describe(module: nn.Module, names: dict[nn.Module, str]) -> str:
    return f"{names.get(module) or '(the root)'!r} ({type(module).__name__})"


# -------------------------------------------------------------------------------------------------- the execution


@dataclass
class _Materializer:
    """The state of one ``materialize_shards`` call, kept across units: tied parameters and what to undo."""

    device: torch.device
    names: dict[nn.Module, str]
    #: Values ``load_state_dict`` gave meta tensors (``LoadsOnMeta``): they replace the initial values.
    loaded: dict[Tensor, Tensor] = field(default_factory=dict)
    #: Each meta parameter's real replacement, and the module that registered it first.
    real: dict[nn.Parameter, nn.Parameter] = field(default_factory=dict)
    registered_by: dict[nn.Parameter, nn.Module] = field(default_factory=dict)
    #: Per module, its parameters that another module registered first (tied weights): name -> meta parameter.
    tied: dict[nn.Module, dict[str, nn.Parameter]] = field(default_factory=dict)
    #: (``module._parameters`` or ``module._buffers``, name, the meta tensor it held), in order.
    replaced: list[tuple[dict, str, Tensor]] = field(default_factory=list)

    def materialize(self, unit: _Unit) -> list[nn.Parameter]:
        """Allocate, initialize and check ``unit``; returns the full parameters it registered first."""
        first = len(self.replaced)
        allocated = {module: self._allocate(module) for module in unit.modules}
        for module, initializer in unit.steps:
            self._run(module, initializer)
        with torch.no_grad():
            for tensors, name, meta in self.replaced[first:]:
                if meta in self.loaded:
                    tensors[name].copy_(self.loaded[meta])
        for module, tensors in allocated.items():
            self._check_written(unit, module, tensors)
        return [m._parameters[n] for m, tensors in allocated.items() for kind, n in tensors if kind == "parameter"]

    def undo(self) -> None:
        """Put every replaced tensor back: the modules are on the meta device again, as before."""
        for tensors, name, meta in reversed(self.replaced):
            tensors[name] = meta
        self.replaced.clear()

    def _allocate(self, module: nn.Module) -> list[tuple[str, str]]:
        """Real, unwritten tensors for ``module``'s meta parameters and buffers; returns the ("parameter" or
        "buffer", name) of those it owns (a parameter it shares with a module visited before is not its own)."""
        own = []
        for name, param in module._parameters.items():
            if param is None or not param.is_meta:
                continue
            if param in self.real:
                self.tied.setdefault(module, {})[name] = param
            else:
                self.real[param] = nn.Parameter(_unwritten_like(param, self.device), param.requires_grad)
                self.registered_by[self.real[param]] = module
                own.append(("parameter", name))
            self._replace(module._parameters, name, self.real[param])
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                self._replace(module._buffers, name, _unwritten_like(buffer, self.device))
                own.append(("buffer", name))
        return own

    def _replace(self, tensors: dict, name: str, tensor: Tensor) -> None:
        self.replaced.append((tensors, name, tensors[name]))
        tensors[name] = tensor

    def _run(self, module: nn.Module, initializer: Initializer) -> None:
        """Run one initializer of ``module``, its tied parameters swapped for scratch tensors."""
        what, call = initializer
        kept = {name: module._parameters[name] for name in self.tied.get(module, {})}
        for name, meta in self.tied.get(module, {}).items():
            module._parameters[name] = nn.Parameter(torch.empty_like(meta, device=self.device))
        try:
            with torch.no_grad():
                call()
        except Exception as error:
            raise RuntimeError(
                f"materializing module {_describe(module, self.names)} from the meta device: {what} failed "
                f"({type(error).__name__}: {error})"
            ) from error
        finally:
            module._parameters.update(kept)

    def _check_written(self, unit: _Unit, module: nn.Module, tensors: list[tuple[str, str]]) -> None:
        for kind, name in tensors:
            tensor = (module._parameters if kind == "parameter" else module._buffers)[name]
            if _holds_unwritten(tensor):
                ran = [what for m, (what, _) in unit.steps if m is module or m is unit.modules[-1]]
                raise RuntimeError(
                    f"module {_describe(module, self.names)} was built on the meta device, and its {kind} {name!r} "
                    f"was not (fully) initialized by {' then '.join(ran) or 'any initializer'}: a value computed in "
                    "__init__ is lost on the meta device. Compute it in reset_parameters(), or build this module in "
                    "__init__ instead of configure_model()"
                )


def _sentinel(dtype: torch.dtype) -> float | int:
    """A value no initializer writes: NaN, the most negative signed integer, the largest unsigned one (for booleans,
    the byte 0xFF, which is neither True nor False)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    info = torch.iinfo(dtype)
    return info.min if info.min < 0 else info.max


def _as_bits(tensor: Tensor) -> Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def _unwritten_like(meta: Tensor, device: torch.device) -> Tensor:
    tensor = torch.empty_like(meta, device=device)
    bits = _as_bits(tensor)
    bits.fill_(_sentinel(bits.dtype))
    return tensor


def _holds_unwritten(tensor: Tensor) -> bool:
    """One reduction and no temporary the size of ``tensor``: NaN propagates through ``amax``, and the integer
    sentinels are extremes."""
    bits = _as_bits(tensor)
    if bits.numel() == 0:
        return False
    if bits.is_complex():
        bits = torch.view_as_real(bits)
    if bits.is_floating_point():
        return bool(bits.amax().isnan())
    sentinel = _sentinel(bits.dtype)
    return bool((bits.amin() if sentinel < 0 else bits.amax()) == sentinel)
