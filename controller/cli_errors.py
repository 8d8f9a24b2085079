"""How an `evocache` command fails, for every room's commands: one plain line to stderr, then an exit status.

    from evocache.controller.cli_errors import EXIT_FAILED, error, usage

    raise error(f"error: {path}: not UTF-8 text", EXIT_FAILED)   # exit 1
    raise usage("--window", "must be at least 10")                 # "error: --window: ...", exit 2

``Failed`` is a ``typer.Exit``: raised anywhere under a command, it ends the command with its code. A plain line,
not click's usage box: rich would wrap a long list of known names at 80 columns. Output paths are checked before
the work starts (``writable``). The dsl room, which imports no other room, keeps its own (`evocache policy
check`'s codes).
"""

from __future__ import annotations

from pathlib import Path

import typer

EXIT_FAILED = 1
EXIT_USAGE = 2


class Failed(typer.Exit):
    """Raised after the message is printed; ``code`` is the exit status."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def error(message: str, code: int) -> Failed:
    """Print ``message`` to stderr as it is; the ``Failed`` to raise."""
    typer.echo(message, err=True)
    return Failed(code)


def usage(option: str, message: str) -> Failed:
    """An option's value cannot be used: exit 2, naming the option."""
    return error(f"error: {option}: {message}", EXIT_USAGE)


def unwritable(path: Path, *, directory: bool = False) -> str | None:
    """Why ``path`` cannot be written, or None when it can; checked before a command's work, so a long run
    never ends on an output it cannot write. A file: not a directory, its directory exists and takes a new file,
    and an existing file is writable. A ``directory`` (a cache): made here if missing, parents too, and takes a
    new file. Writes and removes a nameless temporary file: permission bits say nothing of what root may do,
    nor of a read-only mount.
    """
    import os
    import tempfile

    if directory:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"{path}: cannot make the directory: {exc.strerror or exc}"
        where = path
    else:
        where = path.parent
        if path.is_dir():
            return f"{path}: is a directory"
        if not where.is_dir():
            return f"{path}: the directory {where} does not exist"
        if path.exists() and not os.access(path, os.W_OK):
            return f"{path}: not writable"
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        return f"{path}: cannot write in {where}: {exc.strerror or exc}"
    return None


def writable(option: str, path: Path | None, *, directory: bool = False) -> None:
    """Raise ``Failed`` (exit 2, naming the option and the path) unless ``path`` is None or can be written
    (see ``unwritable``)."""
    why = None if path is None else unwritable(path, directory=directory)
    if why is not None:
        raise usage(option, why)
