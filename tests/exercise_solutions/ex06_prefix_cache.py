"""Exercise answered by the project's own engine/block_manager.py: the cache is loaded into a real
BlockManager (hash_to_block_id, each block's tokens and parent) and BlockManager.find_cached_blocks walks it."""

from contextlib import contextmanager
from typing import NamedTuple

import torch

from mini_transformer.engine import block_manager as bm
from mini_transformer.engine.sequence import Sequence
from mini_transformer.inference.sampling import SamplingParams

chain_hash = bm.hash_block_tokens


class CachedBlock(NamedTuple):
    block_id: int
    token_ids: tuple
    parent: int | None


@contextmanager
def _hashing_with(hash_fn):
    saved, bm.hash_block_tokens = bm.hash_block_tokens, hash_fn
    try:
        yield
    finally:
        bm.hash_block_tokens = saved


def _sequence(tokens):
    return Sequence("q", list(tokens), SamplingParams(max_tokens=1), (), 0, torch.device("cpu"))


def block_hashes(tokens, block_size, hash_fn=chain_hash):
    with _hashing_with(hash_fn):
        return bm.BlockManager(1, block_size).block_hashes(_sequence(tokens), len(tokens) // block_size)


def lookup(tokens, block_size, cache, hash_fn=chain_hash):
    ids = [c.block_id for c in cache.values()] + [c.parent for c in cache.values() if c.parent is not None]
    manager = bm.BlockManager(max(ids, default=0) + 1, block_size)
    for block_hash, cached in cache.items():
        block = manager.blocks[cached.block_id]
        block.block_hash, block.token_ids = block_hash, tuple(cached.token_ids)
        if cached.parent is not None:
            block.parent = manager.blocks[cached.parent]
            block.parent_generation = block.parent.generation
        manager.hash_to_block_id[block_hash] = cached.block_id
    with _hashing_with(hash_fn):
        return manager.find_cached_blocks(_sequence(tokens))
