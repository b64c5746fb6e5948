"""Grader for ex11_kv_store_lookup: chain keys, the entry checks and the longest-run lookup over tiers, against a
reference written out step by step below and against hand-built cases (gaps, tier order, guards)."""

from __future__ import annotations

import hashlib
import random
from array import array

EXERCISE = "ex11_kv_store_lookup"
FP, OTHER_FP = b"F" * 16, b"G" * 16


def digest(parent: bytes, tokens) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def reference_keys(tokens, block_size, fingerprint):
    keys, parent = [], b""
    for i in range((len(tokens) - 1) // block_size):
        parent = digest(parent, tokens[i * block_size:(i + 1) * block_size])
        keys.append(fingerprint + parent)
    return keys


def entry(solution, tokens, fingerprint=FP, kv=b"kv", damaged=False):
    good = hashlib.blake2b(kv, digest_size=16).digest()
    return solution.Entry(fingerprint, tuple(tokens), kv, bytes(16) if damaged else good)


def stored(solution, tokens, block_size, blocks):
    """{key: entry} for the given block indices of `tokens`."""
    keys = reference_keys(tokens, block_size, FP)
    return {keys[i]: entry(solution, tokens[i * block_size:(i + 1) * block_size], kv=bytes([i])) for i in blocks}


def test_chain_keys_cover_the_full_blocks_before_the_last_token(solution):
    tokens = list(range(10))
    assert solution.chain_keys(tokens, 4, FP) == reference_keys(tokens, 4, FP)
    assert len(solution.chain_keys(tokens[:9], 4, FP)) == 2, "9 tokens: blocks 0 and 1 end before token 8"
    assert len(solution.chain_keys(tokens[:8], 4, FP)) == 1, "8 tokens: block 1 holds the last token"
    assert solution.chain_keys([5], 4, FP) == []


def test_keys_name_whole_prefixes_and_the_model(solution):
    a, b = [1, 2, 3, 4, 9, 9, 9, 9, 0], [7, 7, 7, 7, 9, 9, 9, 9, 0]
    ka, kb = solution.chain_keys(a, 4, FP), solution.chain_keys(b, 4, FP)
    assert ka[1] != kb[1], "the same block after another prefix must get another key (the chain)"
    assert solution.chain_keys(a, 4, OTHER_FP)[0] != ka[0], "another model, another key"
    assert all(k.startswith(FP) for k in ka)


def test_entry_ok_is_the_guard(solution):
    good = entry(solution, (1, 2, 3, 4))
    assert solution.entry_ok(good, FP, (1, 2, 3, 4))
    assert not solution.entry_ok(good, FP, (1, 2, 3, 5)), "other tokens under the key: a collision"
    assert not solution.entry_ok(good, OTHER_FP, (1, 2, 3, 4)), "another model's entry"
    assert not solution.entry_ok(entry(solution, (1, 2, 3, 4), damaged=True), FP, (1, 2, 3, 4)), "damaged K/V"


def test_the_run_stops_at_the_first_gap(solution):
    tokens = list(range(21))
    run, refused = solution.lookup(tokens, 4, FP, [stored(solution, tokens, 4, [0, 1, 3, 4])])
    assert [e.kv for _, e in run] == [b"\x00", b"\x01"] and refused == 0, "block 2 is missing: 3 and 4 are useless"


def test_each_block_comes_from_the_fastest_tier_that_has_it(solution):
    tokens = list(range(17))
    host, redis = stored(solution, tokens, 4, [0, 2]), stored(solution, tokens, 4, [0, 1, 2, 3])
    run, _ = solution.lookup(tokens, 4, FP, [host, redis])
    assert [t for t, _ in run] == [0, 1, 0, 1]


def test_a_refused_entry_ends_the_run_and_is_counted(solution):
    tokens = list(range(17))
    tiers = stored(solution, tokens, 4, [0, 1, 2, 3])
    keys = reference_keys(tokens, 4, FP)
    tiers[keys[1]] = entry(solution, [9, 9, 9, 9])  # a collision: the key of block 1, other tokens
    run, refused = solution.lookup(tokens, 4, FP, [tiers])
    assert len(run) == 1 and refused == 1
    tiers[keys[1]] = entry(solution, tokens[4:8], fingerprint=OTHER_FP)
    assert solution.lookup(tokens, 4, FP, [tiers]) == (run, 1)
    tiers[keys[1]] = entry(solution, tokens[4:8], damaged=True)
    assert solution.lookup(tokens, 4, FP, [tiers]) == (run, 1)


def test_matches_the_reference_on_random_stores(solution):
    rng = random.Random(0)
    for _ in range(200):
        bs = rng.choice([1, 2, 4])
        tokens = [rng.randrange(3) for _ in range(rng.randint(1, 20))]
        n = (len(tokens) - 1) // bs
        tiers = [stored(solution, tokens, bs, [i for i in range(n) if rng.random() < 0.7]) for _ in range(2)]
        for tier in tiers:
            for key in list(tier):
                if rng.random() < 0.1:
                    tier[key] = entry(solution, [0] * bs, damaged=rng.random() < 0.5)
        expected, refused = [], 0
        for i, key in enumerate(reference_keys(tokens, bs, FP)):
            t = next((t for t, tier in enumerate(tiers) if key in tier), None)
            if t is None:
                break
            e = tiers[t][key]
            ok = e.token_ids == tuple(tokens[i * bs:(i + 1) * bs]) and e.fingerprint == FP and \
                hashlib.blake2b(e.kv, digest_size=16).digest() == e.checksum
            if not ok:
                refused = 1
                break
            expected.append((t, e))
        assert solution.lookup(tokens, bs, FP, tiers) == (expected, refused), (tokens, bs)
