"""The wheel: installed non-editable, ``lightning-zero train`` finds the config tree inside the package (pyproject.toml
maps the repository's conf/ and recipes/ into it) and the wheel holds every module of lightning_zero/.

Built offline from a copy of the source (setuptools writes build/ and *.egg-info next to pyproject.toml), installed
with ``pip install --target`` into a scratch folder, and run with that folder on PYTHONPATH from outside the
repository, so that neither the checkout nor the development install can stand in for it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_zero.config import option_defaults

REPO = Path(__file__).resolve().parents[2]
#: What the wheel is built from.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "lightning_zero", "conf", "recipes")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _ok([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(work / "dist"), str(source)])
    (wheel,) = (work / "dist").glob("lightning_zero-*.whl")
    _ok([*pip, "install", "--no-deps", "--no-index", "--target", str(work / "site"), str(wheel)])
    return work / "site"


def _ok(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr[-3000:]}"
    return result


#: Runs in one interpreter (importing torch and Lightning takes seconds): prints where the installed command reads its
#: config tree from, then runs the installed `lightning_zero.cli` module as `python -m` does, once per command line.
DRIVER = """
import json, runpy, sys
import lightning_zero.cli as cli
print(json.dumps([cli.__file__, str(cli.CONF_DIR), str(cli.RECIPES_DIR)]))
for args in json.loads(sys.argv[1]):
    sys.argv = ["lightning-zero", *args]
    print("=== " + " ".join(args), flush=True)
    try:
        runpy.run_module("lightning_zero.cli", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        assert exit_.code == 0, args
"""
COMMANDS = {
    "default": ["train", "--cfg", "job"],
    "gpt_small_zero3": ["train", "recipe=gpt_small_zero3", "--cfg", "job"],
    # A recipe whose defaults list overrides another group (`override /model: gpt_large`).
    "gpt_large_zero3": ["train", "recipe=gpt_large_zero3", "--cfg", "job"],
}


@pytest.fixture(scope="module")
def installed_run(site) -> dict:
    env = {**os.environ, "PYTHONPATH": str(site)}
    command = [sys.executable, "-c", DRIVER, json.dumps(list(COMMANDS.values()))]
    where, *outputs = _ok(command, cwd=site.parent, env=env).stdout.split("\n=== ")
    configs = {name: OmegaConf.create(out.split("\n", 1)[1]) for name, out in zip(COMMANDS, outputs)}
    return {"where": json.loads(where), **configs}


def test_the_wheel_holds_every_module_of_the_package(site):
    source = {p.relative_to(REPO).as_posix() for p in (REPO / "lightning_zero").rglob("*.py")}
    installed = {p.relative_to(site).as_posix() for p in (site / "lightning_zero").rglob("*.py")}
    missing = sorted(source - installed)
    assert not missing, f"not in the wheel: {missing} (setup.py lists the packages)"


def test_the_installed_command_reads_the_config_tree_inside_the_package(site, installed_run):
    assert installed_run["where"] == [
        str(site / "lightning_zero" / "cli" / "__init__.py"),
        str(site / "lightning_zero" / "conf"),
        str(site / "lightning_zero" / "recipes"),
    ]
    assert sorted(p.name for p in (site / "lightning_zero" / "recipes").glob("*.yaml")) == sorted(
        p.name for p in (REPO / "recipes").glob("*.yaml")
    )


def test_the_installed_command_composes_the_default_and_the_recipes(installed_run):
    default = installed_run["default"]
    assert default.strategy._target_ == "lightning_zero.ZeroStrategy" and default.strategy.stage == 3
    assert set(default.strategy) == {"_target_", *option_defaults(), "start_method"}
    assert (default.strategy.units, default.model.model_config.n_layer, default.seq_len) == ([], 4, 128)

    small = installed_run["gpt_small_zero3"]
    assert (small.strategy.stage, small.strategy.units, small.trainer.max_steps) == (3, ["Block"], 300)
    assert small.model.model_config.n_layer == 4

    large = installed_run["gpt_large_zero3"]
    assert (large.model.model_config.n_layer, large.model.model_config.d_model, large.seq_len) == (12, 768, 256)
    assert (large.strategy.stage, large.strategy.units) == (3, ["Block"])
