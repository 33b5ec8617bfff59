"""What ``train`` checks before any process starts, beyond what building the objects checks. Each was found by the
property tests of tests/unit/test_config_properties.py: it passed every check, then failed on every rank with a
traceback per rank, or failed with a message that names no field:

- ``units`` and ``activation_checkpointing_policy`` entries that match no module of the model (only known once the
  model is built: here on the meta device, as the strategy's setup would see it);
- ``offload_dir`` missing or not writable under disk offload;
- launch settings: a ``start_method`` that does not exist (Lightning's message names no field), and those added with
  ``+strategy.NAME=VALUE``: a ``timeout`` that is not a ``timedelta``, an unknown ``process_group_backend`` and,
  under ``strategy=ddp``, a field that ``DistributedDataParallel`` does not take (``DDPStrategy`` passes its extra
  keyword arguments on to it);
- Trainer arguments Lightning only checks as training runs (``accumulate_grad_batches=0`` and
  ``val_check_interval=0`` divide by zero in the fit loop).
"""

from __future__ import annotations

import copy
import inspect
import os
import warnings
from pathlib import Path
from typing import Any

from lightning_zero.cli.compose import prefixed
from lightning_zero.cli.errors import UsageError, first_line
from lightning_zero.config_checks import ZeroConfigError, check_launch_settings


def check_before_launch(cfg: Any, strategy: Any, model: Any) -> None:
    """Raise ``UsageError`` naming the field if the run built from ``cfg`` would fail once its ranks started."""
    from lightning_zero import ZeroStrategy

    _check_trainer(cfg.trainer)
    _check_launch_settings(cfg.strategy)
    if isinstance(strategy, ZeroStrategy):
        _check_offload_dir(strategy.config.offload)
        _check_against_model(strategy.config, model)


def _check_trainer(node: Any) -> None:
    accumulate = node.get("accumulate_grad_batches", 1)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise UsageError(f"trainer.accumulate_grad_batches={accumulate!r} is invalid: it must be an integer >= 1")
    interval = node.get("val_check_interval")  # durations ("00:00:10:00") are Lightning's to check
    if isinstance(interval, (int, float)) and not (interval >= 1 if isinstance(interval, int) else 0 < interval <= 1):
        raise UsageError(
            f"trainer.val_check_interval={interval!r} is invalid: it must be a number of steps >= 1, a fraction of "
            "an epoch in (0, 1], a duration or null"
        )


def _check_launch_settings(node: Any) -> None:
    from hydra.utils import get_object
    from lightning.pytorch.strategies import DDPStrategy
    from omegaconf import DictConfig

    from lightning_zero import ZeroStrategy

    timeout = node.get("timeout")
    if timeout is not None and not (isinstance(timeout, DictConfig) and "_target_" in timeout):
        raise UsageError(
            f"strategy.timeout={timeout!r} is invalid: it must be a timedelta, e.g. "
            f"'+strategy.timeout={{_target_:datetime.timedelta,seconds:{timeout}}}'"
        )
    try:
        check_launch_settings(node.get("start_method"), node.get("process_group_backend"))
    except ZeroConfigError as err:
        raise UsageError(f"strategy.{err}") from None
    target = get_object(node._target_) if "_target_" in node else None
    if isinstance(target, type) and issubclass(target, DDPStrategy) and not issubclass(target, ZeroStrategy):
        _check_ddp_fields(node, target)


def _check_ddp_fields(node: Any, target: type) -> None:
    from torch.nn.parallel import DistributedDataParallel

    own = [p for p in inspect.signature(target).parameters if p != "kwargs"]
    wrapper = [p for p in inspect.signature(DistributedDataParallel).parameters if p not in ("module", "process_group")]
    for key in node:
        if not str(key).startswith("_") and key not in own and key not in wrapper:
            raise UsageError(
                f"strategy.{key} is not a parameter of {node._target_} or of the DistributedDataParallel it builds: "
                f"allowed fields are {', '.join(own + wrapper)}"
            )


def _check_offload_dir(offload: Any) -> None:
    where = offload.offload_dir
    if not offload.on_disk or where is None:
        return
    if not Path(where).is_dir():
        raise UsageError(f"strategy.offload_dir={where!r} does not exist or is not a directory")
    if not os.access(where, os.W_OK | os.X_OK):
        raise UsageError(f"strategy.offload_dir={where!r} is not writable")


def _check_against_model(config: Any, model: Any) -> None:
    """Match ``units`` and ``activation_checkpointing_policy`` against a meta-device copy of the model, in the order
    the strategy's setup applies them (checkpoint wrappers first, then the unit plan)."""
    from lightning_zero.lightning_compat import apply_activation_checkpointing
    from lightning_zero.sharding.units import plan_units

    units = config.stage3.units if config.stage == 3 else ()
    policy = config.activation_checkpointing_policy
    if not (units or policy):
        return
    network = _on_meta(model)
    if network is None:
        return
    try:
        with warnings.catch_warnings():  # a partial match warns, and the ranks will warn again
            warnings.simplefilter("ignore")
            apply_activation_checkpointing(network, policy)
            if units:
                plan_units(network, units, config.stage3.unit_bytes)
    except ValueError as err:
        raise UsageError(prefixed("strategy", first_line(err))) from None


def _on_meta(model: Any) -> Any:
    """A copy of ``model`` with the modules ``configure_model`` builds, on the meta device; None if it has none."""
    import torch

    configure = getattr(model, "configure_model", None)
    if not callable(configure):
        return None
    network = copy.deepcopy(model)
    with torch.device("meta"):
        network.configure_model()
    return network
