"""The checks of ``ZeroStrategy``'s options that need nothing of the configuration classes (config.py): the error
they raise, value checks shared by the option groups, and the launch settings passed on to Lightning."""

from __future__ import annotations

import dataclasses
from typing import Any


class ZeroConfigError(ValueError):
    """A configuration value is invalid; the message names the option and the allowed values."""


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def all_ints(*values: object) -> bool:
    return all(isinstance(v, int) for v in values)


def check_quantize_grads(quantize_grads: str | None, shard_group_size: int | None) -> None:
    """qgZ's quantized reduce-scatter runs over the world's nodes: not under hybrid sharding, whose bytes across
    nodes are the replica all-reduce it does not quantize."""
    if quantize_grads is None:
        return
    if shard_group_size is not None:
        raise ZeroConfigError(
            f"quantize_grads={quantize_grads!r} with shard_group_size={shard_group_size!r} is not supported: hybrid "
            "sharding's traffic across nodes is the full-precision all-reduce of the shard, which qgZ does not "
            "quantize; use node_size to tell qgZ where the nodes are instead"
        )


#: Why each of stage 3's options (``Stage3Config``) means nothing to stages 1 and 2, which gather no units.
STAGE3_ONLY: dict[str, str] = {
    "units": "it names the modules stage 3 gathers together",
    "unit_mb": "it sizes the units stage 3 gathers",
    "prefetch": "it sets how many units stage 3 gathers ahead",
    "reshard_after_forward": "it sets when stage 3 frees a gathered unit",
    "verify_unit_order": "it checks the order of stage 3's unit collectives",
    "buffer_pool_mb": "it bounds the buffers of stage 3's unit gathers",
    "quantize_weights": "it quantizes stage 3's parameter all-gathers",
}


def refuse_stage3_options(stage: int, options: Any, defaults: Any) -> None:
    """Stage 3's ``options`` set away from their ``defaults`` under stage 1 or 2 are refused, naming the first, rather
    than ignored: a run would otherwise train without what its configuration says."""
    if stage == 3:
        return
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if value != getattr(defaults, f.name):
            raise ZeroConfigError(f"{f.name}={value!r} needs stage=3 ({STAGE3_ONLY[f.name]}), got stage={stage}")


def refuse_on_device(buffer_pool_mb: float | None, device: Any) -> None:
    """What means nothing on the run's ``device``, which is known only at setup: refused there, on every rank, before
    anything is sharded. ``buffer_pool_mb`` on CUDA, whose caching allocator reuses freed buffers already, so that no
    pool is kept there (sharding/in_flight.py, [Note: what the buffer pools keep, and where])."""
    if buffer_pool_mb is not None and device.type == "cuda":
        raise ZeroConfigError(
            f"buffer_pool_mb={buffer_pool_mb!r} is invalid on {device}: CUDA's caching allocator reuses freed buffers "
            "and no pool is kept there; leave it null (the default) on CUDA"
        )


def check_launch_settings(start_method: Any = None, process_group_backend: Any = None, timeout: Any = None) -> None:
    """The launch settings ``ZeroStrategy`` passes on to Lightning and ``torch.distributed``, checked where they are
    given: both accept bad values and fail later, inside every rank (an unknown backend, a timeout in seconds)."""
    import multiprocessing
    from datetime import timedelta

    import torch.distributed as dist

    methods = ["popen", *multiprocessing.get_all_start_methods()]
    if start_method is not None and start_method not in methods:
        raise ZeroConfigError(f"start_method={start_method!r} is invalid: allowed values are {', '.join(methods)}")
    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]  # fake: torch's own tests'
    available = [b for b in known if dist.is_backend_available(b)]
    names = None  # a composite backend ("cpu:gloo,cuda:nccl") names one backend per device type
    if isinstance(process_group_backend, str):
        names = [part.split(":")[-1] for part in process_group_backend.split(",")]
    if process_group_backend is not None and not (names and all(name in available for name in names)):
        raise ZeroConfigError(
            f"process_group_backend={process_group_backend!r} is invalid: allowed values are {', '.join(available)}, "
            "or none for the accelerator's default"
        )
    if timeout is not None and not isinstance(timeout, timedelta):
        raise ZeroConfigError(f"timeout={timeout!r} is invalid: it must be a datetime.timedelta")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_mib(name: str, value: Any) -> None:
    if not is_number(value) or not 0 < value < float("inf"):
        raise ZeroConfigError(f"{name}={value!r} is invalid: it must be a number of MiB > 0")


def check_bool(config: Any, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise ZeroConfigError(f"{name}={getattr(config, name)!r} is invalid: it must be true or false")


def check_optional_bool(config: Any, *names: str) -> None:
    for name in names:
        if getattr(config, name) is not None and not isinstance(getattr(config, name), bool):
            raise ZeroConfigError(f"{name}={getattr(config, name)!r} is invalid: it must be true, false or null (auto)")


def check_names(name: str, value: Any) -> None:
    if isinstance(value, str) or not isinstance(value, tuple) or not all(isinstance(u, str) and u for u in value):
        raise ZeroConfigError(f"{name}={value!r} is invalid: it must be a list of module class names or module paths")


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its class name if it has none): errors are reported in one line."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
