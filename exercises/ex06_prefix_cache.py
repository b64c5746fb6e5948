"""Exercise (docs/06 section 4): the prefix cache's lookup over a hash chain.

Fill in `block_hashes` and `lookup`, then grade them:

    uv run pytest exercises/test_ex06_prefix_cache.py

A FULL block of block_size tokens is named by a hash that chains its parent's hash and its own tokens:

    hash(block 0) = hash_fn(None, tokens of block 0)
    hash(block i) = hash_fn(hash(block i-1), tokens of block i)

so equal hashes name equal whole prefixes. The cache maps a hash to the CachedBlock that holds those
tokens' K/V. A hash can collide (the grader even uses a hash_fn that always returns 0), so a hit is
checked exactly: the cached block must hold the same token ids, and its parent must be the block matched
just before it (None for the first block). A prompt whose blocks are all cached must still compute its
last token (the step needs that token's logits), so only the full blocks among the first
len(tokens) - 1 tokens are looked up.
"""

from __future__ import annotations

from typing import NamedTuple


class CachedBlock(NamedTuple):
    block_id: int
    token_ids: tuple[int, ...]  # the tokens whose K/V the block holds
    parent: int | None  # the block id of the block before it in the sequence that filled it; None: first


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))  # the engine's hash_block_tokens


def block_hashes(tokens: list[int], block_size: int, hash_fn=chain_hash) -> list[int]:
    """The hash chain of the FULL blocks of `tokens` (a last, partly filled block has no hash)."""
    # TODO 1: one hash per full block that identifies the block together with everything before it
    raise NotImplementedError("TODO: exercise ex06_prefix_cache, block_hashes")


def lookup(tokens: list[int], block_size: int, cache: dict[int, CachedBlock], hash_fn=chain_hash) -> list[int]:
    """The block ids of the longest run of leading blocks of `tokens` found in `cache` (hash -> block)."""
    # TODO 2: the blocks that may come from the cache: the step must still compute at least one token
    # TODO 3: accept leading blocks only while the cache really holds THIS prefix: a hash can collide, and
    #         a cached block filled after a different block is not this prefix either
    raise NotImplementedError("TODO: exercise ex06_prefix_cache, lookup")
