"""Large-model init for stage 3: turn a module built on the meta device into local shards, one module at a time.

[Note: initial values of a model built on the meta device]
Under ``configure_model()`` (and ``Trainer.init_module()``) a stage-3 strategy builds the model on the meta device,
where nothing is allocated and no random numbers are drawn, and records at that moment the state of the generator
that initializes tensors on the training device (the CPU's, or the CUDA device's, as an eager build there would use). Setup then
visits the modules in ``module.modules()`` order, starting from that RNG state: each module's own meta parameters and
buffers are allocated in full, its ``reset_parameters()`` runs, the local rows of each parameter are copied out and
the full storage is freed before the next module. No rank ever holds more than one module's parameters in full.

Every rank draws the same numbers, and they are the numbers an eager build would have drawn when each module draws
its initial values in ``reset_parameters()`` and modules are constructed in the order they are registered, which
holds for torch.nn's layers and for models composed of them. A weight tied to another (``lm_head.weight =
wte.weight``) keeps the values of the module that registered it first, and the later module's ``reset_parameters()``
still runs on a scratch tensor so that the random stream advances as in the eager build. A module that owns meta
parameters or buffers but has no ``reset_parameters()`` cannot be initialized and is reported by name.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_zero.sharding.flat_param import ShardSpec


def rng_state(device: torch.device) -> Tensor:
    """The state of the generator that initializes tensors on ``device`` (the CPU's, or that CUDA device's)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.random.get_rng_state()


def _set_rng_state(device: torch.device, state: Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.random.set_rng_state(state)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def materialize_shards(
    root: nn.Module, device: torch.device, generator_state: Tensor | None, rank: int, world_size: int
) -> dict[nn.Parameter, tuple[torch.Size, Tensor]]:
    """Replace every meta parameter and buffer of ``root`` by a real one on ``device``.

    Parameters come back empty (the stage-3 sharded state); the returned dict maps each of them to its full shape
    and its local rows. See [Note: initial values of a model built on the meta device].
    """
    if generator_state is not None:
        _set_rng_state(device, generator_state)
    real: dict[nn.Parameter, nn.Parameter] = {}
    local_rows: dict[nn.Parameter, tuple[torch.Size, Tensor]] = {}
    names = {m: n for n, m in root.named_modules()}
    for module in root.modules():
        fresh = _allocate_direct(module, device, real)
        meta_buffers = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        for name in meta_buffers:
            module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
        fresh_ids = {id(p) for p in fresh}
        real_ids = {id(p) for p in real.values()}
        own = list(module.named_parameters(recurse=False))
        tied = [n for n, p in own if id(p) in real_ids and id(p) not in fresh_ids]
        if not (fresh or meta_buffers or tied):
            continue
        if not hasattr(module, "reset_parameters"):
            if fresh or meta_buffers:
                what = [n for n, p in own if id(p) in fresh_ids] + meta_buffers
                raise RuntimeError(
                    f"module {names[module] or type(module).__name__!r} ({type(module).__name__}) was built on the "
                    f"meta device and owns {what}, but has no reset_parameters() to initialize them: define "
                    "reset_parameters(), or create the module in __init__ instead of configure_model()"
                )
            continue
        _reset_with_scratch_for(module, tied, device)
        for param in fresh:
            spec = ShardSpec(param.shape, rank, world_size)
            local_rows[param] = (param.shape, spec.local_view(param.detach()).clone())
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return local_rows


def _allocate_direct(module: nn.Module, device: torch.device, real: dict) -> list[nn.Parameter]:
    """Give ``module`` real, uninitialized tensors for the meta parameters it registers first."""
    fresh = []
    for name, param in module.named_parameters(recurse=False):
        if not param.is_meta:
            continue
        if param in real:
            module._parameters[name] = real[param]
            continue
        new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
        real[param] = new
        module._parameters[name] = new
        fresh.append(new)
    return fresh


def _reset_with_scratch_for(module: nn.Module, tied: list[str], device: torch.device) -> None:
    """Run ``reset_parameters()``; parameters initialized by an earlier module are swapped for scratch tensors."""
    kept = {name: module._parameters[name] for name in tied}
    for name, param in kept.items():
        module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device))
    try:
        with torch.no_grad():
            module.reset_parameters()
    finally:
        for name, param in kept.items():
            module._parameters[name] = param
