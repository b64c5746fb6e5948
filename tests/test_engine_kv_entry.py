"""One store entry (engine/kv_entry.py) against its definition: decode_block gives back exactly the K/V
encode_block was given, under the same store key and MAC key, and refuses the value when anything
differs: the secret (absent or wrong), the key it is read under, or any byte, even with an unkeyed
digest recomputed over the changed bytes. The connector's use of it: test_engine_kv_connector.py."""

from __future__ import annotations

import hashlib

import pytest
import torch

from mini_transformer.engine.kv_entry import DIGEST, MIN_SECRET_BYTES, decode_block, encode_block, mac_key_for

FINGERPRINT, TOKENS, KEY = b"f" * 16, [1, 2, 3, 4], b"mtkv:block-3"
SECRET = b"a secret the replicas share"


def signed(kv: torch.Tensor, secret: bytes | None = SECRET, key: bytes = KEY) -> bytes:
    return encode_block(FINGERPRINT, 4, TOKENS, kv, store_key=key, mac_key=mac_key_for(secret))


def read(value: bytes, secret: bytes | None = SECRET, key: bytes = KEY, kv_like: torch.Tensor | None = None):
    kv_like = torch.empty(2, 2, 4, 2, 8) if kv_like is None else kv_like
    return decode_block(value, FINGERPRINT, TOKENS, kv_like.shape, kv_like.dtype, store_key=key,
                        mac_key=mac_key_for(secret))


def test_a_signed_entry_reads_back_with_the_secret_and_its_key():
    kv = torch.randn(2, 2, 4, 2, 8)
    assert torch.equal(read(signed(kv)), kv)
    assert torch.equal(read(signed(kv, None), None), kv)  # unsigned: the unkeyed digest


def test_wrong_or_absent_secret_and_another_key_are_refused():
    kv = torch.randn(2, 2, 4, 2, 8)
    assert read(signed(kv, None)) is None  # planted without the secret (the project's own encoder)
    assert read(signed(kv, b"another secret, just as long")) is None  # planted with a wrong secret
    assert read(signed(kv), key=b"mtkv:block-4") is None  # replayed under another key
    assert read(signed(kv), secret=None) is None  # a replica without the secret cannot read signed entries


@pytest.mark.parametrize("forge", ["zeroed", "negated"])
def test_changed_kv_with_a_recomputed_digest_is_refused(forge):
    """The K/V changed in place and the digest recomputed as anyone without the secret can: an
    unkeyed blake2b checksum of the value, and this format's digest with no secret."""
    kv = torch.randn(2, 2, 4, 2, 8)
    value = signed(kv)
    head = value[:len(value) - DIGEST - kv.numel() * 4]
    changed = torch.zeros_like(kv) if forge == "zeroed" else -kv
    body = changed.numpy().tobytes()
    unkeyed = hashlib.blake2b(head + body, digest_size=DIGEST).digest()
    assert read(head + body + unkeyed) is None
    assert read(encode_block(FINGERPRINT, 4, TOKENS, changed, store_key=KEY, mac_key=b"")) is None
    assert read(head + body + value[-DIGEST:]) is None  # the real MAC, kept over changed K/V


def test_a_short_or_non_bytes_secret_is_refused():
    with pytest.raises(ValueError, match=f"at least {MIN_SECRET_BYTES} bytes"):
        mac_key_for(b"short")
    with pytest.raises(ValueError, match="at least"):
        mac_key_for("a str secret, long enough")
    assert mac_key_for(None) == b"" and len(mac_key_for(b"x" * 1000)) == 32  # any length, hashed first
