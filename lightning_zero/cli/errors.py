"""Bad input from the command line: every subcommand reports it as one line naming the field and the allowed values,
with exit code 2 (argparse's own code for usage errors)."""

from __future__ import annotations

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input from the command line: the message is one line naming the field and the allowed values."""


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
