"""Durations in policy documents: ``30s``, ``5m``, ``2h``, ``1d``, ``1h30m``, ``1.5h`` or a number of seconds.

``parse_duration`` turns any of these into float seconds; ``format_duration`` gives the one normalised
spelling that policy documents are written back with, so ``90``, ``"90s"`` and ``"1m30s"`` all normalise to
``"1m30s"`` and a diff never shows a change that is only a change of spelling.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from .errors import brief

# Largest unit first: the normalised spelling uses each unit at most once, in this order.
_UNITS: dict[str, int] = {"d": 86_400, "h": 3_600, "m": 60, "s": 1}

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_PART = re.compile(rf"({_NUMBER})([dhms])")
_WHOLE = re.compile(rf"(?:{_NUMBER}[dhms])+")

DURATION_HINT = "a number of seconds or a duration such as 30s, 5m, 2h, 1d, 1h30m"


def parse_duration(value: object) -> float:
    """Seconds in ``value``: an int or float (seconds) or a duration string.

    Units appear at most once and largest first (``1h30m``, not ``30m1h``). Raises ``ValueError`` naming the
    accepted forms for anything else, including booleans, NaN and infinities. The sign is not checked here:
    callers bound the result (a ttl must be positive).
    """
    if isinstance(value, bool):
        # YAML reads `yes`/`on` as booleans; seconds are never meant.
        raise ValueError(f"expected {DURATION_HINT}; got a boolean")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_text(value.strip())
    else:
        raise ValueError(f"expected {DURATION_HINT}; got {type(value).__name__}")
    if not math.isfinite(seconds):
        raise ValueError(f"expected a finite duration; got {brief(value)}")
    return seconds


def _parse_text(text: str) -> float:
    try:
        return float(text)  # "600" or "2.5" written as a string: still seconds
    except ValueError:
        pass
    if not _WHOLE.fullmatch(text):
        raise ValueError(f"invalid duration {brief(text)}: expected {DURATION_HINT}")
    parts = _PART.findall(text)
    units = [unit for _, unit in parts]
    order = list(_UNITS)
    if len(set(units)) != len(units) or units != sorted(units, key=order.index):
        raise ValueError(f"invalid duration {brief(text)}: use each unit once, largest first (like 1h30m)")
    return sum(float(number) * _UNITS[unit] for number, unit in parts)


def format_duration(seconds: float) -> str:
    """The normalised spelling of ``seconds``: whole seconds as ``1d2h3m4s`` (zero parts left out), anything
    with a fraction as plain seconds (``2.5s``), so that ``parse_duration(format_duration(x)) == x`` exactly.

    Raises ``ValueError`` for negative or non-finite values.
    """
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"cannot format {seconds!r} as a duration")
    if seconds != int(seconds):
        # repr's digits round-trip exactly; Decimal spells them without an exponent, which the grammar lacks.
        return f"{Decimal(repr(seconds)):f}s"
    rest = int(seconds)
    if rest == 0:
        return "0s"
    out = []
    for unit, size in _UNITS.items():
        count, rest = divmod(rest, size)
        if count:
            out.append(f"{count}{unit}")
    return "".join(out)
