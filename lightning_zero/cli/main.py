"""The ``lightning-zero`` entry point: argument parsing and the table of subcommands.

Each subcommand is a module of this package with one ``add_<name>`` function that declares its parser and the
function that runs it; a new subcommand is one more such function in ``_SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from lightning_zero.cli.consolidate import add_consolidate
from lightning_zero.cli.errors import EXIT_USAGE, UsageError
from lightning_zero.cli.estimate import add_estimate
from lightning_zero.cli.train import add_train, train

_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (add_train, add_estimate, add_consolidate)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # everything after `train` is Hydra's, flags included (argparse would take --help)
        command, run = "train", lambda: train(argv[1:])
    else:
        args = _parser().parse_args(argv)
        command, run = args.command, lambda: args.run(args)
    try:
        return run()
    except UsageError as err:
        print(f"lightning-zero {command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-zero", description="ZeRO data parallelism for PyTorch Lightning: train and plan runs."
    )
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subcommands)
    return parser
