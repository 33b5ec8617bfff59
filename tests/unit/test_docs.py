"""The documentation: the MkDocs site builds with ``--strict`` (broken links, missing references and docstring
errors fail), and README.md stays short, with CI's test command first."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CI_COMMAND = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e '.[dev]' && python -m pytest"
)


def _readme_lines():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read().splitlines()


def test_readme_is_short():
    assert len(_readme_lines()) <= 200


def test_readme_ci_command():
    # CI runs the first line that starts with `python3 -m venv` and runs pytest.
    first = next(line for line in _readme_lines() if line.startswith("python3 -m venv") and "pytest" in line)
    assert first == CI_COMMAND


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (the docs extra)")
def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "api" / "index.html").exists()
