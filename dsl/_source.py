"""Reading a policy file: regular files only, at most ``MAX_POLICY_BYTES``, UTF-8.

The checks come before any byte is parsed, so that no file can make loading hang or grow without bound:

- the path is checked with ``stat`` before it is opened, and the open file again with ``fstat`` (the path may
  have been replaced in between) before it is read: a FIFO, a device (``/dev/zero``), a socket or a directory
  is a ``PolicyFileError``, never read, and never opened unless it replaced a regular file in between (opening
  a device can act: a watchdog starts counting). The open does not block;
- a regular file larger than ``MAX_POLICY_BYTES`` is a ``PolicyError`` naming the file and the limit, and at most
  ``MAX_POLICY_BYTES + 1`` bytes are ever read (a file that grows while it is read is caught too);
- text that is not UTF-8 is a ``PolicyError`` at the line and column of the first byte that does not decode.
"""

from __future__ import annotations

import os
import stat
from os import PathLike

from ._yaml import MAX_DOCUMENT_CHARS, index_position
from .errors import PolicyError, PolicyFileError, PolicyIssue

# A file of at most this many bytes decodes to at most MAX_DOCUMENT_CHARS characters.
MAX_POLICY_BYTES = MAX_DOCUMENT_CHARS

# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; a regular file ignores the flag.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def read_policy_text(path: str | PathLike[str]) -> str:
    """The text of the policy file at ``path``.

    Raises ``OSError`` when it cannot be opened (``FileNotFoundError``, ``PermissionError``),
    ``PolicyFileError`` (also an ``OSError``) when it is not a regular file, and ``PolicyError`` when it is
    larger than ``MAX_POLICY_BYTES`` or not UTF-8.
    """
    source = str(path)
    _require_regular(source, os.stat(path).st_mode)
    fd = os.open(path, _OPEN_FLAGS)
    try:
        _require_regular(source, os.fstat(fd).st_mode)
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_POLICY_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_POLICY_BYTES:
        raise PolicyError(
            [PolicyIssue(source, None, None, "", f"file is larger than the limit of {MAX_POLICY_BYTES} bytes")]
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError([_undecodable(source, raw, exc)]) from None


def _require_regular(source: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a plain file")
        raise PolicyFileError(source, f"not a regular file ({kind}); a policy is read from a file")


def _undecodable(source: str, raw: bytes, exc: UnicodeDecodeError) -> PolicyIssue:
    """The issue for the first byte that is not UTF-8: its line and its column in characters, counted as YAML
    counts them (the text before it decodes, being before the first bad byte)."""
    before = raw[: exc.start].decode("utf-8")
    where = index_position(before, len(before))
    return PolicyIssue(
        source,
        where.line,
        where.column,
        "",
        f"not UTF-8 text: byte 0x{raw[exc.start]:02x} cannot be decoded ({exc.reason})",
    )
