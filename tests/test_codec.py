"""The stored form of an entry: exact round trip, and no damaged, displaced or forged blob ever decodes."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evocache.controller._codec import (
    FORMAT_VERSION,
    OVERHEAD,
    EntryCodec,
    check_keys,
    check_ns,
    encoded_size,
)
from evocache.controller._types import L2, L3, Entry
from evocache.controller.errors import CorruptEntry, TierError

NS = "tenant-a"
CODEC = EntryCodec(b"the test deployment's secret")
encode_entry, decode_entry = CODEC.encode, CODEC.decode
KEY = "0123456789abcdef"
ENTRY = Entry(
    b"the answer",
    expires_at=1_700_000_060.5,
    created_at=1_700_000_000.25,
    rule="greedy",
    saved_ms=812.0,
    sliding_ttl=60.0,
)

finite = st.floats(allow_nan=False)
entries = st.builds(
    Entry,
    value=st.binary(max_size=300),
    expires_at=st.none() | finite,
    created_at=finite,
    rule=st.text(max_size=40),
    saved_ms=finite,
    sliding_ttl=st.none() | finite,
    saved_tokens=st.integers(0, 2**64 - 1),
    saved_cost=finite,
)


@settings(max_examples=200, deadline=None)
@given(
    entry=entries,
    ns=st.from_regex(r"[A-Za-z0-9._-]{1,128}", fullmatch=True),
    key=st.from_regex(r"[0-9a-f]{16,128}", fullmatch=True),
)
def test_round_trip_is_exact(entry: Entry, ns: str, key: str) -> None:
    blob = encode_entry(ns, key, entry)
    assert len(blob) == encoded_size(entry)
    assert decode_entry(ns, key, blob, tier=L2) == entry


def test_absent_and_zero_times_stay_distinct() -> None:
    absent = Entry(b"v", expires_at=None, created_at=0.0, sliding_ttl=None)
    zero = Entry(b"v", expires_at=0.0, created_at=0.0, sliding_ttl=0.0)
    assert decode_entry(NS, KEY, encode_entry(NS, KEY, absent), tier=L2) == absent
    assert decode_entry(NS, KEY, encode_entry(NS, KEY, zero), tier=L2) == zero


def test_layout_size() -> None:
    blob = encode_entry(NS, KEY, ENTRY)
    assert len(blob) == OVERHEAD + len("greedy") + len(b"the answer")
    assert blob[:4] == b"EVC" + bytes([FORMAT_VERSION])


def _fails(blob: bytes, message: str, ns: str = NS, key: str = KEY) -> None:
    with pytest.raises(CorruptEntry) as caught:
        decode_entry(ns, key, blob, tier=L3)
    assert caught.value.tier == L3
    assert str(caught.value) == f"l3: entry {ns}/{key}: {message}"


def test_every_single_bit_flip_fails() -> None:
    blob = encode_entry(NS, KEY, ENTRY)
    for bit in range(len(blob) * 8):
        damaged = bytearray(blob)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptEntry):
            decode_entry(NS, KEY, bytes(damaged), tier=L3)


def test_every_truncation_fails() -> None:
    blob = encode_entry(NS, KEY, ENTRY)
    for length in range(len(blob)):
        with pytest.raises(CorruptEntry):
            decode_entry(NS, KEY, blob[:length], tier=L3)


def test_exact_errors() -> None:
    blob = encode_entry(NS, KEY, ENTRY)
    _fails(b"", "0 bytes, shorter than any entry")
    _fails(blob[: OVERHEAD - 1], f"{OVERHEAD - 1} bytes, shorter than any entry")
    _fails(b"XYZ" + blob[3:], "bad magic b'XYZ'")
    _fails(
        blob[:3] + bytes([FORMAT_VERSION + 1]) + blob[4:], f"unsupported format version {FORMAT_VERSION + 1}"
    )
    _fails(blob + b"\0", "checksum mismatch")
    _fails(blob[:-1], "checksum mismatch")


def test_blob_is_bound_to_its_key_and_namespace() -> None:
    blob = encode_entry(NS, KEY, ENTRY)
    _fails(blob, "checksum mismatch", key="0123456789abcdee")
    _fails(blob, "checksum mismatch", ns="tenant-b")
    # The boundary between namespace and key is part of what is hashed.
    assert encode_entry("ab", "c" * 16, ENTRY) != encode_entry("abc", "c" * 16, ENTRY)


def test_a_blob_signed_under_another_secret_fails() -> None:
    other = EntryCodec(b"another deployment's secret")
    _fails(other.encode(NS, KEY, ENTRY), "checksum mismatch")
    assert other.encode(NS, KEY, ENTRY)[:-16] == encode_entry(NS, KEY, ENTRY)[:-16]  # only the tag differs


def test_the_expiry_is_signed() -> None:
    blob = bytearray(encode_entry(NS, KEY, ENTRY))
    blob[5:13] = struct.pack("<d", ENTRY.expires_at + 3600)  # a later expiry, written over the header's
    _fails(bytes(blob), "checksum mismatch")


def test_secrets_are_checked() -> None:
    with pytest.raises(ValueError, match="secret is 15 bytes; at least 16 are needed"):
        EntryCodec(b"x" * 15)
    with pytest.raises(TypeError, match="secret must be bytes, not str"):
        EntryCodec("a secret of enough characters")  # type: ignore[arg-type]
    assert repr(EntryCodec(b"a secret that must not be shown")) == "EntryCodec(<secret>)"


def test_corrupt_entry_is_a_tier_error() -> None:
    assert issubclass(CorruptEntry, TierError)


def test_caller_bugs() -> None:
    with pytest.raises(ValueError, match="65536 bytes"):
        encode_entry(NS, KEY, Entry(b"v", None, 0.0, rule="r" * 65536))
    with pytest.raises(TypeError, match="must be bytes, not str"):
        encode_entry(NS, KEY, Entry("v", None, 0.0))  # type: ignore[arg-type]


@pytest.mark.parametrize("ns", ["a", "tenant-a", "A.b_c-9", "x" * 128])
def test_valid_namespaces(ns: str) -> None:
    check_ns(ns)


@pytest.mark.parametrize("ns", ["", "x" * 129, "a:b", "a b", "a/b", "ü", "a\n", "a*", 7, None])
def test_invalid_namespaces(ns: object) -> None:
    with pytest.raises(ValueError, match="invalid namespace"):
        check_ns(ns)  # type: ignore[arg-type]


def test_keys() -> None:
    check_keys(["0" * 16, "f" * 128, "0123456789abcdef" * 4])
    check_keys([])
    for bad in [
        "0" * 15,
        "f" * 129,
        "0123456789ABCDEF",
        "g" * 16,
        "0" * 16 + "\n",
        "0" * 15 + ":",
        b"0" * 16,
    ]:
        with pytest.raises(ValueError, match="invalid cache key"):
            check_keys(["0" * 16, bad])  # type: ignore[list-item]
