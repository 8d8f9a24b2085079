"""Reading a small file that configures security (a key file, an API-key table) without trusting what lies at
its path: a FIFO or a device put there is refused instead of waited on or read without end."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotARegularFile(OSError):
    """The path names a FIFO, a device, a socket or a directory."""


def read_bounded(path: str | os.PathLike[str], max_bytes: int) -> tuple[bytes, int]:
    """At most ``max_bytes + 1`` bytes of the regular file at ``path`` (one more than allowed, so a caller can
    tell an oversized file) and its ``st_mode``, for the caller's checks of size and permissions.

    Opened non-blocking, so a FIFO is refused at once. Raises ``NotARegularFile`` for anything but a regular
    file and ``OSError`` when it cannot be opened or read."""
    fd = os.open(Path(path), os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode  # before any file object: one refuses a directory with its own error
        if not stat.S_ISREG(mode):
            raise NotARegularFile(f"{path} is not a regular file")
        with open(fd, "rb", closefd=False) as fh:
            return fh.read(max_bytes + 1), mode
    finally:
        os.close(fd)
