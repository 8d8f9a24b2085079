"""Turning cached values into payload bytes and back.

The default serializer never unpickles: a payload read from Redis or disk is data, not code. It takes str, bytes,
JSON documents (str-keyed dicts, lists, numbers, bools, None) and a top-level tuple of those; anything else is
``Unserializable`` and the call is served uncached. ``PickleSerializer`` takes any picklable value and is opt-in
(``@cache_if(..., serializer="pickle")``) for deployments whose Redis and disk are trusted.

Streams are stored as their chunk list (each chunk str or bytes, length-prefixed) so a hit replays the same
chunks, in order, byte for byte.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Sequence
from typing import Any, Protocol


class Unserializable(TypeError):
    """The value cannot be stored by this serializer; the call is served uncached."""


class Serializer(Protocol):
    """``loads`` raises ``ValueError`` (or ``UnicodeDecodeError``) for a payload it cannot read, and nothing
    else: the caller drops such an entry and recomputes."""

    name: str

    def dumps(self, value: Any) -> bytes: ...

    def loads(self, payload: bytes) -> Any: ...


_LEN = struct.Struct(">I")


def _utf8(text: str) -> bytes:
    """Strict UTF-8: a str with a lone surrogate ("\\ud800") has no UTF-8 form and is ``Unserializable``."""
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise Unserializable(f"text is not valid Unicode: {exc.reason} at {exc.start}") from exc


def dump_chunks(chunks: Sequence[str | bytes]) -> bytes:
    parts = [b"S"]
    for chunk in chunks:
        if type(chunk) is str:
            data = _utf8(chunk)
            parts.append(b"s")
        elif type(chunk) is bytes:
            data = chunk
            parts.append(b"b")
        else:
            raise Unserializable(f"stream chunks must be str or bytes, got {type(chunk).__qualname__}")
        parts.append(_LEN.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def load_chunks(payload: bytes) -> list[str | bytes]:
    if payload[:1] != b"S":
        raise ValueError("not a stream payload")
    chunks: list[str | bytes] = []
    pos, end = 1, len(payload)
    while pos < end:
        kind = payload[pos : pos + 1]
        if pos + 5 > end:
            raise ValueError("truncated stream payload")
        (n,) = _LEN.unpack_from(payload, pos + 1)
        pos += 5
        data = payload[pos : pos + n]
        if len(data) != n or kind not in (b"s", b"b"):
            raise ValueError("truncated or malformed stream payload")
        chunks.append(data.decode() if kind == b"s" else data)
        pos += n
    return chunks


class JsonSerializer:
    """str, bytes and JSON documents, with a one-byte tag. Round trips exactly or refuses."""

    name = "json"

    def dumps(self, value: Any) -> bytes:
        t = type(value)
        if t is str:
            return b"s" + _utf8(value)
        if t is bytes:
            return b"b" + value
        tag = b"t" if t is tuple else b"j"
        try:
            text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            # json turns nested tuples into lists and int dict keys into strings: refuse what would not
            # round trip.
            back = json.loads(text)
        except (TypeError, ValueError, RecursionError) as exc:
            raise Unserializable(f"not a JSON document: {type(exc).__name__}: {exc}") from exc
        if (tuple(back) if tag == b"t" else back) != value:
            raise Unserializable("value does not round-trip through JSON (nested tuples or non-str keys)")
        return tag + _utf8(text)

    def loads(self, payload: bytes) -> Any:
        tag, body = payload[:1], payload[1:]
        if tag == b"s":
            return body.decode()
        if tag == b"b":
            return bytes(body)
        if tag == b"j":
            return json.loads(body)
        if tag == b"t":
            return tuple(json.loads(body))
        raise ValueError(f"unknown payload tag {tag!r}")


class PickleSerializer:
    """Any picklable value. Only for stores whose contents you trust: unpickling runs code."""

    name = "pickle"

    def dumps(self, value: Any) -> bytes:
        try:
            return b"p" + pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - a value's own __reduce__ can raise anything
            raise Unserializable(f"{type(exc).__name__}: {exc}") from exc

    def loads(self, payload: bytes) -> Any:
        if payload[:1] != b"p":
            raise ValueError("not a pickle payload")
        try:
            return pickle.loads(payload[1:])  # noqa: S301 - opt-in, documented above
        except Exception as exc:  # noqa: BLE001 - unpickling can raise anything (a class gone since a deploy)
            raise ValueError(f"payload does not unpickle: {type(exc).__name__}: {exc}") from exc


SERIALIZERS: dict[str, Serializer] = {"json": JsonSerializer(), "pickle": PickleSerializer()}
