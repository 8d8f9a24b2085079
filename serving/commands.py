"""The serving room's `evocache` command, for the face to mount: `evocache serve` (``_commands``: the embedded
application on a local Ray)."""

from ._commands import serve

__all__ = ["serve"]
