"""Chained block hashes of a tokenised prompt (controller/_blocks.py): stable, chained, salted, bounded."""

from __future__ import annotations

import hashlib
import struct

import pytest

from evocache.controller import MAX_BLOCK_TOKENS, BlockHash, block_hashes

EXTRAS = ("tiny-llama", "rev-1", "bfloat16", "")
TOKENS = list(range(10))


def test_a_known_prompt_gives_known_digests():
    hashes = block_hashes(TOKENS, 4, EXTRAS, "tenant-a")
    assert [h.hex() for h in hashes] == [
        "8fe53ee2c65dbb3aeaa8336644b9be5e23593eade75428933c3864af6e1ad866",
        "3fc02d8f5e37c7510b618e621100a499405dd4e0aa9e864075afe6c43deff20f",
    ]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)


def test_the_first_block_is_the_documented_encoding():
    extras = struct.pack("<I", 1) + struct.pack("<I", 1) + b"m"
    data = b"\x00" + struct.pack("<I", 1) + b"t" + extras + struct.pack("<I", 2) + struct.pack("<2Q", 7, 8)
    expected = hashlib.blake2b(data, digest_size=32, person=b"evocache.block1").digest()
    first = block_hashes([7, 8], 2, ["m"], "t")[0]
    assert first == expected
    second = block_hashes([7, 8, 9, 10], 2, ["m"], "t")[1]
    data = b"\x01" + first + extras + struct.pack("<I", 2) + struct.pack("<2Q", 9, 10)
    assert second == hashlib.blake2b(data, digest_size=32, person=b"evocache.block1").digest()


def test_a_str_salt_is_its_utf8_bytes():
    as_bytes = "tenant-é".encode()
    assert block_hashes(TOKENS, 4, EXTRAS, "tenant-é") == block_hashes(TOKENS, 4, EXTRAS, as_bytes)


@pytest.mark.parametrize(
    ("extras", "salt"),
    [
        (EXTRAS, "tenant-b"),
        (("tiny-llama", "rev-2", "bfloat16", ""), "tenant-a"),
        (("tiny-llama", "rev-1", "float16", ""), "tenant-a"),
        (("tiny-llama", "rev-1", "bfloat16", "adapter-x"), "tenant-a"),
        (("tiny-llama", "rev-1", "bfloat16"), "tenant-a"),
        (("tiny-llamarev-1", "", "bfloat16", ""), "tenant-a"),  # same concatenation, other fields
    ],
)
def test_another_tenant_or_extra_key_changes_every_hash(extras, salt):
    base = block_hashes(TOKENS * 3, 4, EXTRAS, "tenant-a")
    other = block_hashes(TOKENS * 3, 4, extras, salt)
    assert len(base) == len(other) == 7
    assert not set(base) & set(other)


@pytest.mark.parametrize("changed", range(5))
def test_a_change_in_block_i_changes_blocks_i_onward_only(changed):
    tokens = list(range(20))
    edited = list(tokens)
    edited[changed * 4 + 3] += 100
    base = block_hashes(tokens, 4, EXTRAS, "tenant-a")
    after = block_hashes(edited, 4, EXTRAS, "tenant-a")
    assert base[:changed] == after[:changed]
    assert all(b != a for b, a in zip(base[changed:], after[changed:], strict=True))


def test_only_full_blocks_are_hashed():
    full = block_hashes(TOKENS[:8], 4, EXTRAS, "tenant-a")
    assert block_hashes(TOKENS, 4, EXTRAS, "tenant-a") == full
    assert block_hashes(TOKENS[:8] + [99, 98, 97], 4, EXTRAS, "tenant-a") == full
    assert block_hashes(TOKENS[:3], 4, EXTRAS, "tenant-a") == ()
    assert block_hashes([], 4, EXTRAS, "tenant-a") == ()


def test_the_same_tokens_in_another_position_hash_differently():
    hashes = block_hashes([1, 2, 3, 4] * 2, 4, EXTRAS, "tenant-a")
    assert hashes[0] != hashes[1]


def test_block_size_is_part_of_the_hash():
    assert block_hashes(TOKENS[:8], 8, EXTRAS, "t")[0] != block_hashes(TOKENS[:8], 4, EXTRAS, "t")[1]


def test_work_is_bounded_by_the_token_cap():
    assert len(block_hashes([0] * MAX_BLOCK_TOKENS, 4096, (), "t")) == MAX_BLOCK_TOKENS // 4096
    too_many = f"{MAX_BLOCK_TOKENS + 1} tokens, more than the {MAX_BLOCK_TOKENS}"
    with pytest.raises(ValueError, match=too_many):
        block_hashes([0] * (MAX_BLOCK_TOKENS + 1), 4096, (), "t")


@pytest.mark.parametrize(
    ("tokens", "block_size", "extras", "error", "match"),
    [
        ([1, 2], 0, (), ValueError, "block_size must be an int >= 1, got 0"),
        ([1, 2], True, (), ValueError, "block_size must be an int >= 1, got True"),
        ([1, -2], 2, (), ValueError, r"token_ids\[1\] must be an int in \[0, 2\*\*64\), got -2"),
        ([1, 2, 3, 1.5], 2, (), ValueError, r"token_ids\[3\] must be an int"),
        ([1, 2**64], 2, (), ValueError, r"token_ids\[1\] must be an int"),
        ([1, 2], 2, "model", TypeError, "extra_keys must be a sequence of strings, not a single string"),
        ([1, 2], 2, ("m", 3), TypeError, r"extra_keys\[1\] must be a string, got int"),
    ],
)
def test_bad_input_is_refused_with_its_place(tokens, block_size, extras, error, match):
    with pytest.raises(error, match=match):
        block_hashes(tokens, block_size, extras, "t")


def test_block_hash_is_a_bytes_newtype():
    assert BlockHash(b"x") == b"x"
