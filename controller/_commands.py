"""What the controller's `evocache` commands share: how a command fails with a message and an exit status.

A command's helpers print one plain line to stderr and raise ``Failed``; the command catches it and exits with
its code. (A plain line, not click's usage box: rich would wrap a long list of known names at 80 columns.)
"""

from __future__ import annotations

import typer

EXIT_FAILED = 1
EXIT_USAGE = 2


class Failed(Exception):
    """Raised after the message is printed; ``code`` is the exit status."""

    def __init__(self, code: int) -> None:
        self.code = code


def error(message: str, code: int) -> Failed:
    typer.echo(message, err=True)
    return Failed(code)


def usage(option: str, message: str) -> Failed:
    """An option's value cannot be used: exit 2, naming the option."""
    return error(f"error: {option}: {message}", EXIT_USAGE)
