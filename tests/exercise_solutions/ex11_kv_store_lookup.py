"""Exercise answered by the project's own code: engine/kv_connector.py's extend_chain (the key chain)
and longest_run (the walk over the tiers), engine/kv_entry.py's decode_block (the checks). An Entry is
written in the store's format by encode_block first, so the project's checks judge it; an Entry whose
checksum does not match its K/V stands for a damaged value, and is encoded with one byte flipped."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch

from mini_transformer.engine.kv_connector import extend_chain, longest_run
from mini_transformer.engine.kv_entry import chain_digest, decode_block, encode_block


class Entry(NamedTuple):
    fingerprint: bytes
    token_ids: tuple[int, ...]
    kv: bytes
    checksum: bytes


def checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def chain_keys(tokens, block_size, fingerprint):
    return [fingerprint + d for d in extend_chain([], tokens, block_size, (len(tokens) - 1) // block_size)]


def entry_ok(entry, fingerprint, token_ids):
    kv = torch.frombuffer(bytearray(entry.kv), dtype=torch.uint8)
    value = bytearray(encode_block(entry.fingerprint, len(entry.token_ids), entry.token_ids, kv))
    if checksum(entry.kv) != entry.checksum:
        value[len(value) // 2] ^= 0x01  # the damage the checksum stands for
    return decode_block(bytes(value), fingerprint, list(token_ids), (len(entry.kv),), torch.uint8) is not None


class _DictTier:
    def __init__(self, entries):
        self.entries = entries

    def get_many(self, keys):
        return [self.entries.get(key) for key in keys]


def lookup(tokens, block_size, fingerprint, tiers):
    def check(i, entry):
        return entry if entry_ok(entry, fingerprint, tuple(tokens[i * block_size:(i + 1) * block_size])) else None

    run, refused = longest_run([_DictTier(t) for t in tiers], chain_keys(tokens, block_size, fingerprint), check)
    return [(t, entry) for t, entry, _ in run], refused


__all__ = ["Entry", "chain_digest", "chain_keys", "checksum", "entry_ok", "lookup"]
