"""The Hydra config tree of ``lightning-zero``: where it is, and what the command adds to it in Hydra's ConfigStore.

[Note: where the config tree is]
In the repository the tree is two top-level folders: ``conf/`` (``config.yaml`` and the groups ``strategy/``,
``model/``, ``data/``, ``trainer/``) and ``recipes/``. A wheel installs files only inside its packages, so
pyproject.toml maps the folders to the packages ``lightning_zero.conf`` and ``lightning_zero.recipes``: an installed
wheel holds them inside the package, at ``lightning_zero/conf`` and ``lightning_zero/recipes``. A source checkout, and
the editable install the README uses (which imports the checkout's ``lightning_zero/``), have no
``lightning_zero/conf``: there the folders sit next to the package. ``find_config_tree`` looks inside the package
first, then next to it. It goes by file path rather than through ``importlib.resources``: only an editable install's
import hook knows that ``lightning_zero.conf`` means ``conf/``, a checkout on ``PYTHONPATH`` has none.

[Note: the recipe group]
Hydra makes a config group of a folder named after the group, and the recipes live in ``recipes/`` (in the repository
as in the wheel), not in ``conf/recipe/``. So ``register_configs`` stores each recipe file in Hydra's ConfigStore under
the group ``recipe``, with the package its ``# @package`` header names, as Hydra's file loader would: ``recipe=NAME``,
``train --help`` and a recipe's own defaults list (``override /model: gpt_large``) work as for a folder
``conf/recipe``. Recipes of one's own can still be a folder: ``--config-dir my_conf`` with ``my_conf/recipe/``.

[Note: the strategy schema]
Every option of ``ZeroStrategy`` and its default are defined once, in ``lightning_zero.config``. ``register_configs``
stores them in the ConfigStore as ``zero_strategy_schema`` (built from ``config.option_defaults()``, plus
``_target_`` and the start method), and ``conf/strategy/zero{1,2,3}.yaml`` extend it, setting only ``stage``: an
option added to ``ZeroConfig`` is in ``strategy=zero1/2/3`` and on the command line with no YAML edit. The schema is
a plain node, not a typed dataclass: ``ZeroConfig`` checks every value, once, with messages that name the field and
the allowed values (OmegaConf's type checks would run first, with their own messages, and would turn ``yes`` into
``true``); and an unknown ``+strategy.NAME=VALUE`` reaches ``ZeroStrategy``, which names its parameters.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_zero import config

#: The ConfigStore name of the strategy schema (top level, so that it is not an option of the strategy group).
STRATEGY_SCHEMA = "zero_strategy_schema"
_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_PACKAGE_HEADER = re.compile(r"#\s*@package\s+(\S+)")


@dataclass(frozen=True)
class ConfigTree:
    """The folder Hydra reads ``config.yaml`` and the config groups from, and the folder of the recipe files."""

    conf: Path
    recipes: Path


def find_config_tree() -> ConfigTree:
    """Inside the package when installed from a wheel, else next to it (see [Note: where the config tree is])."""
    installed = ConfigTree(_PACKAGE_DIR / "conf", _PACKAGE_DIR / "recipes")
    if (installed.conf / "config.yaml").is_file():
        return installed
    return ConfigTree(_PACKAGE_DIR.parent / "conf", _PACKAGE_DIR.parent / "recipes")


def register_configs() -> None:
    """Register what composing the tree needs besides its files: the resolvers, the strategy schema, the recipes."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("lz.devices", _default_devices, replace=True)
    store = ConfigStore.instance()
    store.store(name=STRATEGY_SCHEMA, node=strategy_schema())
    for path in sorted(find_config_tree().recipes.glob("*.yaml")):
        store.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package=_package_of(path))


def strategy_schema() -> dict[str, Any]:
    """``_target_``, every ZeRO option with its default, and the start method (see [Note: the strategy schema])."""
    from lightning_zero import ZeroStrategy

    options = config.option_defaults()
    strategy_wide = [f.name for f in dataclasses.fields(config.ZeroConfig) if f.name in options]
    # The order `train --help` and error messages list the fields in: stage first, as it decides which of the others
    # apply, then the components' options (buckets, reduction, units), then the other strategy-wide ones.
    order = ["stage", *(k for k in options if k not in strategy_wide), *(k for k in strategy_wide if k != "stage")]
    start_method = inspect.signature(ZeroStrategy).parameters["start_method"].default
    return {
        "_target_": "lightning_zero.ZeroStrategy",
        **{k: list(options[k]) if isinstance(options[k], tuple) else options[k] for k in order},
        "start_method": start_method,
    }


def _package_of(path: Path) -> str | None:
    """The package a ``# @package`` header in the file's leading comments names (None: Hydra's default)."""
    with path.open() as lines:
        for line in lines:
            if not line.startswith("#"):
                break
            match = _PACKAGE_HEADER.match(line)
            if match:
                return match.group(1)
    return None


def _default_devices(cpu_processes: int) -> int:
    """Every GPU when there are any, else ``cpu_processes`` CPU processes."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else int(cpu_processes)
