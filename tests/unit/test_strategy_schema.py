"""The Hydra config of ``strategy=zero1/2/3`` comes from ``lightning_zero.config``: every option, its default, and a new
option with no YAML edit (see [Note: the strategy schema] in lightning_zero/cli/config_tree.py)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_zero import ZeroStrategy, config
from lightning_zero.cli import CONF_DIR, register_configs
from lightning_zero.cli.compose import instantiate


def _strategy_node(*overrides: str) -> dict:
    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_container(cfg.strategy)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_option_and_default_comes_from_the_config_dataclasses(stage):
    node = _strategy_node(f"strategy=zero{stage}")
    defaults = {k: list(v) if isinstance(v, tuple) else v for k, v in config.option_defaults().items()}
    assert node == {"_target_": "lightning_zero.ZeroStrategy", **defaults, "stage": stage, "start_method": "popen"}
    # Stage first, then the components' options: the order `train --help` and the error messages use.
    assert list(node)[:3] == ["_target_", "stage", "bucket_mb"]


def test_the_composed_node_builds_the_same_config_as_the_defaults():
    strategy = instantiate("strategy", OmegaConf.create(_strategy_node("strategy=zero3", "strategy.units=[Block]")))
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.config == config.ZeroConfig.from_options(stage=3, units=("Block",))


def test_a_new_option_appears_in_every_stage_and_on_the_command_line(monkeypatch):
    defaults = config.option_defaults
    monkeypatch.setattr(config, "option_defaults", lambda: {**defaults(), "option_added_later": 7})
    try:
        for stage in (1, 2, 3):
            assert _strategy_node(f"strategy=zero{stage}")["option_added_later"] == 7
        assert _strategy_node("strategy=zero2", "strategy.option_added_later=9")["option_added_later"] == 9
    finally:
        monkeypatch.undo()
        register_configs()  # the ConfigStore is global: give the next test the real schema
    assert "option_added_later" not in _strategy_node("strategy=zero3")


@pytest.mark.parametrize("option", ["zero1_offload", "zero3_offload_params", "zero1_offload_disk", "zero3_offload_disk"])
def test_what_estimate_tells_users_to_type_builds_the_option_it_recommends(option):
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_zero import estimate

    said = estimate.how_to_select(option, frozenset(StrategyRegistry.available_strategies()))
    overrides = said.split(" on the command line")[0].split()
    strategy = instantiate("strategy", OmegaConf.create(_strategy_node(*overrides)))
    expected = config.ZeroConfig.from_options(**estimate.LAYOUTS[option].strategy_options())
    assert strategy.config.offload == expected.offload and strategy.config.stage == expected.stage
