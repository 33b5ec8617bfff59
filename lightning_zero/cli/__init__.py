"""The ``lightning-zero`` command: ``train`` (a Hydra app over the config tree), ``estimate`` (the memory model) and
``consolidate`` (a sharded checkpoint to one file); also ``python -m lightning_zero.cli``.

``main.py`` parses the command line and holds the table of subcommands, one module each (``train.py``,
``estimate.py``, ``consolidate.py``); ``config_tree.py`` finds the Hydra config tree (``conf/`` and ``recipes/``) in
a source checkout and in an installed wheel and registers what Hydra needs besides its files; ``compose.py`` composes
and builds it, turning errors into one line (``errors.UsageError``). ``strategy=auto`` is chosen by
``lightning_zero.auto``.
"""

from lightning_zero.cli.config_tree import ConfigTree, find_config_tree, register_configs
from lightning_zero.cli.errors import UsageError
from lightning_zero.cli.main import main

_TREE = find_config_tree()
#: Where the running command reads ``config.yaml`` and the config groups from, and the recipe files.
CONF_DIR, RECIPES_DIR = _TREE.conf, _TREE.recipes

__all__ = ["CONF_DIR", "RECIPES_DIR", "ConfigTree", "UsageError", "find_config_tree", "main", "register_configs"]
