"""Exercise (docs/11 section 3): the KV store's lookup, the longest run of a prompt's blocks that the
tiers hold, with the checks that make a key collision or a damaged entry a miss.

Fill in `chain_keys`, `entry_ok` and `lookup`, then grade them:

    uv run pytest exercises/test_ex11_kv_store_lookup.py

A FULL block of block_size tokens is stored under a key that chains the block before it:

    digest_0 = chain_digest(b"", tokens of block 0)
    digest_i = chain_digest(digest_{i-1}, tokens of block i)
    key_i    = fingerprint + digest_i          (the model's fingerprint first: other weights, other keys)

Tiers are dicts key -> Entry, fastest first (host memory, then Redis). Equal keys should mean equal
prefixes, but a key can collide and an entry can rot or come from another model, so an entry is used
only if its fingerprint is ours, its token ids are the block's, and its checksum matches its K/V.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import NamedTuple


class Entry(NamedTuple):
    fingerprint: bytes  # the model that computed it
    token_ids: tuple[int, ...]  # the block's tokens
    kv: bytes  # the block's K/V for all layers (opaque here)
    checksum: bytes  # checksum(kv) when it was written


def checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def chain_digest(parent: bytes, token_ids) -> bytes:
    """16 bytes; equal in every process (Python's hash() of a tuple is not, across machines and versions)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def chain_keys(tokens: list[int], block_size: int, fingerprint: bytes) -> list[bytes]:
    """The keys of the FULL blocks among tokens[:len(tokens) - 1]: the last token is always computed (the
    step needs its logits), so a block holding it is never looked up."""
    # TODO 1: which blocks a lookup may fetch (the step must still compute the prompt's last token)
    # TODO 2: one key per block that names the block AND everything before it, for this model only
    raise NotImplementedError("TODO: exercise ex11_kv_store_lookup, chain_keys")


def entry_ok(entry: Entry, fingerprint: bytes, token_ids: tuple[int, ...]) -> bool:
    """May this entry stand in for the block holding token_ids? (the collision and corruption guard)"""
    # TODO 3: accept an entry only when it is this model's, holds exactly the expected tokens, and its
    #         K/V arrived intact
    raise NotImplementedError("TODO: exercise ex11_kv_store_lookup, entry_ok")


def lookup(tokens: list[int], block_size: int, fingerprint: bytes, tiers: list[dict[bytes, Entry]]
           ) -> tuple[list[tuple[int, Entry]], int]:
    """The longest unbroken run of leading blocks the tiers give, as [(tier index, entry)], and how many
    entries a check refused. Each block comes from the FASTEST tier holding its key; if that entry fails
    entry_ok, the run ends there (counted as one refusal); the run also ends at the first block no tier
    holds. Blocks after a gap are useless: attention needs every earlier block."""
    # TODO 4: for each block in order, fetch it from the fastest tier that has it
    # TODO 5: the result is a run from block 0: think about what a missing or a rejected block means for
    #         the blocks after it, and count the rejections
    raise NotImplementedError("TODO: exercise ex11_kv_store_lookup, lookup")
