"""The package list, the one setting pyproject.toml cannot express: every package found under lightning_zero/, plus
the config tree's folders conf/ and recipes/, which [tool.setuptools.package-dir] in pyproject.toml maps into the
package (a `packages.find` table would not see them, and a fixed list would miss a package added later)."""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["lightning_zero", "lightning_zero.*"]),
        "lightning_zero.conf",
        "lightning_zero.recipes",
    ]
)
