"""Grader for ex06_prefix_cache: the hash chain against hashes written out by hand, the lookup on hand-made caches
(a hit, a miss in the middle, a fully cached prompt, a collision, a stale parent), and on random prompts
against a plain loop that compares whole prefixes token by token and never hashes."""

from __future__ import annotations

import random

EXERCISE = "ex06_prefix_cache"


def chain(tokens, bs, hash_fn):
    hashes, parent = [], None
    for i in range(len(tokens) // bs):
        parent = hash_fn(parent, tuple(tokens[i * bs:(i + 1) * bs]))
        hashes.append(parent)
    return hashes


def fill(solution, cache, tokens, bs, next_id, hash_fn=None):
    """Store the full blocks of `tokens` as a sequence would that reused the blocks already cached: a new
    block gets the id next_id, next_id + 1, ... and its parent is the block before it. Returns the next id."""
    hash_fn, parent = hash_fn or solution.chain_hash, None
    for i, h in enumerate(chain(tokens, bs, hash_fn)):
        if h not in cache:
            cache[h] = solution.CachedBlock(next_id, tuple(tokens[i * bs:(i + 1) * bs]), parent)
            next_id += 1
        parent = cache[h].block_id
    return next_id


def test_the_hash_chain_covers_full_blocks_only(solution):
    tokens = [5, 6, 7, 8, 9, 10, 11]
    h0 = solution.chain_hash(None, (5, 6, 7))
    assert solution.block_hashes(tokens, 3) == [h0, solution.chain_hash(h0, (8, 9, 10))], \
        "two full blocks of 3; token 11 is in a partly filled block, which has no hash"
    assert solution.block_hashes(tokens[:2], 3) == []


def test_the_same_block_after_a_different_prefix_has_another_hash(solution):
    a, b = solution.block_hashes([1, 2, 7, 7], 2), solution.block_hashes([3, 4, 7, 7], 2)
    assert a[1] != b[1], "block 1 holds (7, 7) in both, but the hash must name the whole prefix"


def test_a_shared_prefix_is_found(solution):
    cache = {}
    fill(solution, cache, [1, 2, 3, 4, 5, 6, 7, 8], 4, next_id=10)
    assert solution.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, cache) == [10, 11]
    assert solution.lookup([1, 2, 3, 4, 0, 0, 0, 0, 9], 4, cache) == [10], "block 1 differs: only block 0 hits"
    assert solution.lookup([0, 2, 3, 4, 5, 6, 7, 8, 9], 4, cache) == [], "block 0 differs: block 1 cannot hit either"


def test_the_walk_stops_at_the_first_miss(solution):
    cache = {}
    fill(solution, cache, [1, 2, 3, 4, 5, 6], 2, next_id=0)
    del cache[solution.chain_hash(solution.chain_hash(None, (1, 2)), (3, 4))]  # block 1 evicted
    assert solution.lookup([1, 2, 3, 4, 5, 6, 7], 2, cache) == [0], "block 2 is cached, but block 1 is not"


def test_a_fully_cached_prompt_still_computes_its_last_token(solution):
    cache = {}
    fill(solution, cache, [1, 2, 3, 4, 5, 6, 7, 8], 4, next_id=0)
    assert solution.lookup([1, 2, 3, 4, 5, 6, 7, 8], 4, cache) == [0], \
        "8 tokens in blocks of 4: only tokens[:7] are looked up, so block 1 is computed again"


def test_a_hash_collision_is_caught_by_the_token_guard(solution):
    def zero(parent, token_ids):
        return 0

    cache = {0: solution.CachedBlock(3, (9, 9), None)}
    assert solution.lookup([1, 2, 3], 2, cache, hash_fn=zero) == [], "same hash, other tokens: not a hit"
    cache = {}
    fill(solution, cache, [1, 2, 1, 2, 1], 2, next_id=0, hash_fn=zero)  # block 1's hash is taken: not stored
    assert solution.lookup([1, 2, 1, 2, 1], 2, cache, hash_fn=zero) == [0], \
        "block 1 matches block 0's tokens and hash, but its parent would be block 0 itself, not None"


def test_a_block_filled_after_another_parent_is_not_a_hit(solution):
    h0 = solution.chain_hash(None, (1, 2))
    cache = {h0: solution.CachedBlock(0, (1, 2), None),
             solution.chain_hash(h0, (3, 4)): solution.CachedBlock(1, (3, 4), 7)}  # filled after block 7
    assert solution.lookup([1, 2, 3, 4, 5], 2, cache) == [0], "block 1's parent is 7, not the block matched (0)"


def reference_lookup(tokens, bs, stored):
    """No hashing at all: the longest run of leading blocks whose whole prefix some stored prompt shares."""
    hits = []
    for i in range((len(tokens) - 1) // bs):
        prefix = tuple(tokens[:(i + 1) * bs])
        owner = next((ids for prompt, ids in stored if tuple(prompt[:len(prefix)]) == prefix), None)
        if owner is None:
            break
        hits.append(owner[i])
    return hits


def test_random_prompts_match_a_lookup_without_hashes(solution):
    rng = random.Random(15)
    for _ in range(200):
        bs, cache, stored, next_id = rng.choice((1, 2, 3)), {}, [], 0
        for _ in range(rng.randint(0, 4)):
            prompt = [rng.randint(0, 2) for _ in range(rng.randint(1, 10))]
            next_id = fill(solution, cache, prompt, bs, next_id)
            stored.append((prompt, [cache[h].block_id for h in chain(prompt, bs, solution.chain_hash)]))
        tokens = [rng.randint(0, 2) for _ in range(rng.randint(1, 12))]
        assert solution.lookup(tokens, bs, cache) == reference_lookup(tokens, bs, stored), \
            f"tokens {tokens}, block size {bs}, cached prompts {[p for p, _ in stored]}"
