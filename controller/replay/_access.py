"""One access in a trace: what every reader yields and what the replay simulator consumes."""

from __future__ import annotations

from typing import NamedTuple


class Access(NamedTuple):
    """One request for one object. A named tuple: traces run to millions of accesses.

    ``t`` is in seconds (readers convert: Mooncake's milliseconds, CSV columns by their mapping). ``size`` is
    in bytes (1 for unit-size traces). ``ns`` is the tenant namespace ("" when the trace has none). For KV
    block traces (Mooncake) ``req`` numbers the request and ``pos`` is the block's position in the request's
    prefix chain (0 = first block); both are -1 for other formats. ``req_out`` is the request's output length
    in tokens (Mooncake's ``output_length``, with ``read_trace(..., output_lengths=True)`` only; -1 otherwise):
    what the request generated, which a server learns when it completes.
    """

    t: float
    key: str
    size: int
    ns: str = ""
    rule: str = ""
    req: int = -1
    pos: int = -1
    req_out: int = -1
