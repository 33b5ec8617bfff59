"""Bad input from the command line: every subcommand reports it as one line naming the field and the allowed values,
with exit code 2 (argparse's own code for usage errors)."""

from __future__ import annotations

from lightning_zero.config_checks import first_line

__all__ = ["EXIT_USAGE", "UsageError", "first_line"]

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input from the command line: the message is one line naming the field and the allowed values."""
