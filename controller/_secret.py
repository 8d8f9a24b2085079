"""The secret that signs entries in the shared tiers (``_codec.EntryCodec``): where it comes from.

In order (``entry_secret``): the store configuration's ``RedisConfig.secret``, its ``RedisConfig.secret_file``,
the environment variable ``EVOCACHE_SECRET``, and otherwise a key file of 32 random bytes that is created on
first use, mode 0600: ``evocache.key`` in the disk tier's directory when there is one, else in the evocache
state directory (``$EVOCACHE_STATE_DIR``, else ``$XDG_STATE_HOME/evocache``, else ``~/.local/state/evocache``).

``EVOCACHE_SECRET`` counts once set, even empty (an empty or short secret is a ``StoreConfigError``, never a
fall back to a key file), and its bytes are taken as they are, UTF-8 or not. A key file, given or made, that
its group or others can write is refused (whoever writes the key can sign entries); one they can read is
logged as a warning (secrets mounted into containers often are).

Every process that shares a Redis must sign with the same secret. A key file serves processes on one host
only, so a Redis store without a configured secret logs a warning: replicas elsewhere would miss every entry
this one writes (never be served it wrongly: an entry signed under another secret is a counted miss).
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from ._codec import MIN_SECRET_BYTES
from ._files import NotARegularFile, read_bounded
from .errors import StoreConfigError

if TYPE_CHECKING:
    from ._store_config import StoreConfig

log = logging.getLogger("evocache.controller.secret")

SECRET_ENV = "EVOCACHE_SECRET"
STATE_DIR_ENV = "EVOCACHE_STATE_DIR"
KEY_FILE = "evocache.key"
_MAX_KEY_FILE = 4096  # a key file is a line of hex; anything larger is not one


def state_dir() -> Path:
    """Where evocache keeps per-user state when the store has no directory of its own."""
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "evocache"


def checked_secret(secret: bytes, source: str) -> bytes:
    """``secret`` if it is long enough; ``StoreConfigError`` naming ``source`` otherwise."""
    if len(secret) < MIN_SECRET_BYTES:
        raise StoreConfigError(f"{source}: the secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} needed")
    return secret


def read_key_file(path: str | os.PathLike[str], source: str) -> bytes:
    """The secret in the key file at ``path`` (surrounding whitespace stripped). A missing, unreadable,
    non-regular, oversized or too short file, or one writable by its group or others, raises
    ``StoreConfigError`` naming ``source`` and the path; one readable by them is logged as a warning."""
    path = Path(path)
    try:
        data, mode = read_bounded(path, _MAX_KEY_FILE)
    except NotARegularFile:
        raise StoreConfigError(f"{source}: {path} is not a regular file") from None
    except OSError as exc:
        raise StoreConfigError(f"{source}: cannot read the key file {path}: {exc.strerror or exc}") from exc
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StoreConfigError(
            f"{source}: {path} is writable by others (mode {stat.S_IMODE(mode):o}): whoever can write "
            f"the key can sign entries every replica serves; chmod go-w {path}"
        )
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        # Only a warning: mounted secrets are often group- or world-readable inside their container.
        log.warning(
            "%s: %s is readable by others (mode %o): whoever can read the key can sign entries; chmod go-r %s",
            source, path, stat.S_IMODE(mode), path,
        )
    if len(data) > _MAX_KEY_FILE:
        raise StoreConfigError(f"{source}: {path} is over {_MAX_KEY_FILE} bytes, not a key file")
    return checked_secret(data.strip(), f"{source} ({path})")


def key_file_secret(directory: str | os.PathLike[str]) -> bytes:
    """The secret in ``directory/evocache.key``, creating the directory and the file (mode 0600, 32 random
    bytes as hex) when absent. Two processes creating it at once end up with the same file: it is written
    under a temporary name and linked into place, which fails for the second."""
    directory = Path(directory)
    path = directory / KEY_FILE
    source = "key file"
    if not path.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(secrets.token_hex(32).encode() + b"\n")
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    pass  # another process made it first: use theirs
            finally:
                tmp.unlink()
        except OSError as exc:
            raise StoreConfigError(f"{source}: cannot create {path}: {exc.strerror or exc}") from exc
    return read_key_file(path, source)


def entry_secret(config: StoreConfig) -> bytes:
    """The secret that signs ``config``'s L2 and L3 entries (the order is in the module docstring).
    Raises ``StoreConfigError`` naming where a bad one came from."""
    redis = config.redis
    if redis is not None and redis.secret is not None:
        return redis.secret.get_secret_value().encode()
    if redis is not None and redis.secret_file is not None:
        return read_key_file(redis.secret_file, "redis.secret_file")
    from_env = os.environ.get(SECRET_ENV)
    if from_env is not None:  # set, even empty (EVOCACHE_SECRET=$UNSET): a mistake, not "no secret"
        # os.fsencode: the variable's own bytes, which need not be UTF-8 (Python holds others as surrogates).
        return checked_secret(os.fsencode(from_env), f"${SECRET_ENV}")
    directory = Path(config.disk.path) if config.disk is not None else state_dir()
    if redis is not None:
        log.warning(
            "no secret configured for the Redis tier: entries are signed with the key file in %s, which only "
            "processes on this host share; set %s (or RedisConfig.secret) for replicas on other hosts",
            directory, SECRET_ENV,
        )
    return key_file_secret(directory)
