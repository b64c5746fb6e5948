"""One entry of the KV store: its format, its MAC, and the digests its key is made of (kv_connector.py).

    value = header (MTKV1, model fingerprint, block size, K/V bytes) | token ids | K/V | MAC

The MAC is a keyed blake2b over the store key and the rest of the value, keyed by a secret the replicas
share: without the secret no one can forge an entry, nor move a real one under another key. Without a
secret it is the same digest unkeyed: it still catches damage and a value replayed under another key,
but not a forger, so a store without one must be writable by trusted processes only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from array import array

import torch

MAGIC = b"MTKV1"
HEADER = struct.Struct("<5s16sII")  # magic, fingerprint, block_size, K/V bytes
DIGEST = 16  # bytes of every blake2b digest here (fingerprint, chain, MAC)
MIN_SECRET_BYTES = 16  # a shorter shared secret could be guessed


def model_fingerprint(model, block_size: int) -> bytes:
    """16 bytes that differ between any two models whose blocks must not be mixed: the config, the
    dtype, the block size and every weight's name, shape and bytes."""
    h = hashlib.blake2b(digest_size=DIGEST)
    h.update(MAGIC + json.dumps(model.config.to_dict(), sort_keys=True).encode())
    h.update(f"{model.tok_emb.weight.dtype} block_size={block_size}".encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        h.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def chain_digest(parent: bytes, token_ids) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=DIGEST).digest()


def mac_key_for(secret: bytes | None) -> bytes:
    """The blake2b key for the replicas' shared secret (None: b"", an unkeyed digest). Hashed first:
    blake2b takes keys of at most 64 bytes, and a secret file may hold more."""
    if secret is not None and (not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES):
        raise ValueError(f"the kv store secret must be at least {MIN_SECRET_BYTES} bytes")
    return b"" if secret is None else hashlib.blake2b(b"mtkv-mac:" + secret, digest_size=32).digest()


def block_mac(mac_key: bytes, store_key: bytes, payload) -> bytes:
    h = hashlib.blake2b(store_key, key=mac_key, digest_size=DIGEST)  # the key it is stored under, then the value
    h.update(payload)
    return h.digest()


def encode_block(fingerprint: bytes, block_size: int, token_ids, kv: torch.Tensor, *, store_key: bytes = b"",
                 mac_key: bytes = b"") -> bytes:
    """value = header | token ids (int64) | K/V (2, n_layer, block_size, Hkv, D) bytes | MAC."""
    body = kv.contiguous().view(torch.uint8).numpy().tobytes()
    head = HEADER.pack(MAGIC, fingerprint, block_size, len(body)) + array("q", token_ids).tobytes()
    return head + body + block_mac(mac_key, store_key, head + body)


def decode_block(value: bytes, fingerprint: bytes, token_ids, shape: tuple, dtype: torch.dtype, *,
                 store_key: bytes = b"", mac_key: bytes = b""):
    """The block's K/V (shape, dtype) if `value`, read under `store_key`, passes every check, else None."""
    n_tokens = len(token_ids)
    kv_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if len(value) != HEADER.size + 8 * n_tokens + kv_bytes + DIGEST:
        return None
    payload = memoryview(value)[:-DIGEST]
    if not hmac.compare_digest(block_mac(mac_key, store_key, payload), value[-DIGEST:]):
        return None  # damaged, forged, or written under another key
    magic, their_fingerprint, block_size, their_kv_bytes = HEADER.unpack_from(value)
    if magic != MAGIC or their_fingerprint != fingerprint or block_size != n_tokens or their_kv_bytes != kv_bytes:
        return None  # another model, or another layout
    stored_ids = array("q")
    stored_ids.frombytes(payload[HEADER.size:HEADER.size + 8 * n_tokens])
    if stored_ids.tolist() != list(token_ids):
        return None  # a key collision: same key, other tokens
    start = HEADER.size + 8 * n_tokens
    return torch.frombuffer(bytearray(payload[start:]), dtype=torch.uint8).view(dtype).view(shape)
