"""Composing the config tree and building its nodes, with Hydra's and the library's errors turned into one line that
names the field and the allowed values (a ``UsageError``).

Every node with a ``_target_`` is built with ``hydra.utils.instantiate(..., _convert_="all")``: the library only ever
receives its own classes, dataclasses and plain containers, never a ``DictConfig``.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning_zero.cli.config_tree import find_config_tree, register_configs
from lightning_zero.cli.errors import UsageError, first_line


def compose(overrides: list[str]) -> Any:
    """The config ``lightning-zero train`` would run with these overrides."""
    from hydra import initialize_config_dir

    tree = find_config_tree()
    if not (tree.conf / "config.yaml").is_file():
        raise UsageError(f"the config tree is missing: no config.yaml in {tree.conf} (is lightning_zero installed?)")
    register_configs()
    with initialize_config_dir(str(tree.conf), version_base="1.3"):
        return _compose(overrides)


def _compose(overrides: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    try:
        return hydra_compose("config", overrides=overrides)
    except MissingConfigException as err:
        group, _, option = (err.missing_cfg_file or "").rpartition("/")
        if not group or not err.options:
            raise UsageError(first_line(err)) from None
        raise UsageError(f"{group}={option} is not an option: allowed values are {', '.join(err.options)}") from None
    except OverrideParseException as err:
        raise UsageError(f"cannot parse the overrides: {first_line(err)}") from None
    except ConfigCompositionException as err:
        if not isinstance(err.__cause__, (ConfigAttributeError, ConfigKeyError)):
            raise UsageError(first_line(err)) from None
        key = err.__cause__.full_key
        others = [o for o in overrides if o.lstrip("+~").split("=")[0] != key]
        raise UsageError(_unknown_field(key, hydra_compose("config", overrides=others))) from None


def _unknown_field(key: str, cfg: Any) -> str:
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import DictConfig, OmegaConf

    parent, _, _ = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    fields = [k for k in node.keys() if not str(k).startswith("_")] if isinstance(node, DictConfig) else []
    if not parent:  # a misspelt group is the likely mistake at the top level
        groups = GlobalHydra.instance().config_loader().list_groups("")
        fields = sorted(set(fields) | {g for g in groups if g != "hydra"})
    where = f"a field of {parent}" if parent else "a config group or field"
    return f"{key} is not {where}: allowed fields are {', '.join(map(str, fields))} (+{key}=VALUE adds a new one)"


def instantiate(group: str, node: Any) -> Any:
    """Build ``node`` (the config of ``group``), reporting a bad value as ``group.field=value is invalid: ...``."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(node, _convert_="all")
    except InstantiationException as err:
        raise UsageError(_instantiation_message(group, node, err)) from None
    except (ValueError, TypeError, ModuleNotFoundError) as err:
        raise UsageError(f"{group}: {first_line(err)}") from None


def _instantiation_message(group: str, node: Any, err: Exception) -> str:
    """``strategy.stage=5 is invalid: ...``: the failing node's key, then the library's own message."""
    from hydra.utils import get_object
    from omegaconf import OmegaConf

    cause = err.__cause__ or err
    lines = str(err).splitlines()
    key = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), group)
    message = first_line(cause)
    if isinstance(cause, TypeError) and "unexpected keyword argument" in message:
        field = message.rsplit(" ", 1)[-1].strip("'")
        sub_key = key.removeprefix(group).lstrip(".")
        target = (OmegaConf.select(node, sub_key) if sub_key else node)._target_
        obj = get_object(target)
        names = obj.option_names() if hasattr(obj, "option_names") else [
            p for p in inspect.signature(obj).parameters if p not in ("self", "args", "kwargs")
        ]
        return f"{key}.{field} is not a parameter of {target}: allowed fields are {', '.join(names)}"
    return prefixed(key, message)


def prefixed(key: str, message: str) -> str:
    """``model`` and ``frozen=... is invalid`` -> ``model.frozen=... is invalid``; other messages get ``model: ``."""
    field = message.split("=", 1)[0]
    return f"{key}.{message}" if "=" in message and field.isidentifier() else f"{key}: {message}"
