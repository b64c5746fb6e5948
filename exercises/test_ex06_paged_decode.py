"""Grader for ex06_paged_decode: decode attention over a block table, checked against the project's
readable reference `paged_decode_attention` (gather every block, mask, one softmax) on random pools."""

from __future__ import annotations

import math

import torch

from mini_transformer.attention.paged import paged_decode_attention

EXERCISE = "ex06_paged_decode"


def random_pool(context_lens, block_size, H, Hkv, D, dtype=torch.float64, spare_blocks=3, seed=0):
    """A pool whose blocks are handed out in a shuffled order (a sequence's blocks are not adjacent), rows
    padded with block 0, which no sequence owns. Returns q, k_cache, v_cache, block_tables, context_lens."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = 1 + sum(need) + spare_blocks
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(context_lens), max(need) + 1, dtype=torch.int64)  # one padding column at least
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor([order.pop() for _ in range(n)])
    k = torch.randn(num_blocks * block_size, Hkv, D, generator=gen, dtype=dtype)
    v = torch.randn(num_blocks * block_size, Hkv, D, generator=gen, dtype=dtype)
    q = torch.randn(len(context_lens), H, D, generator=gen, dtype=dtype)
    return q, k, v, tables, torch.tensor(context_lens, dtype=torch.int64)


def check(solution, context_lens, block_size, H, Hkv, D=8, dtype=torch.float64, seed=0, atol=1e-10):
    q, k, v, tables, lens = random_pool(context_lens, block_size, H, Hkv, D, dtype, seed=seed)
    scale = 1.0 / math.sqrt(D)
    want = paged_decode_attention(q, k, v, tables, lens, block_size, scale)
    got = solution.paged_decode(q, k, v, tables, lens, block_size, scale)
    assert got.shape == want.shape == q.shape and got.dtype == q.dtype, f"shape/dtype {got.shape} {got.dtype}"
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


def test_matches_the_reference_on_ragged_sequences(solution):
    """Lengths that end mid-block, exactly on a block boundary, and a single key; block sizes 1, 4, 16."""
    for block_size in (1, 4, 16):
        lens = [1, block_size, 2 * block_size + 1, 37, 5 * block_size - 1 if block_size > 1 else 9]
        check(solution, lens, block_size, H=4, Hkv=4)


def test_gqa_query_heads_read_their_groups_kv_head(solution):
    for H, Hkv in ((8, 2), (6, 3), (4, 1)):
        check(solution, [3, 20, 11], block_size=4, H=H, Hkv=Hkv, seed=1)


def test_a_later_block_with_a_larger_score_rescales_what_came_before(solution):
    """Keys whose scores grow block after block: each new block raises the running max."""
    q, k, v, tables, lens = random_pool([24, 13], 4, H=2, Hkv=2, D=8, seed=2)
    for s in range(2):
        for p in range(int(lens[s])):
            slot = int(tables[s, p // 4]) * 4 + p % 4
            k[slot] = q[s, 0].view(1, -1) * (0.2 * p)  # key p scores about 0.2·p·|q|²/√D: rises with p
    want = paged_decode_attention(q, k, v, tables, lens, 4, 1 / math.sqrt(8))
    got = solution.paged_decode(q, k, v, tables, lens, 4, 1 / math.sqrt(8))
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_large_scores_do_not_overflow(solution):
    """Scores in the thousands: exp without subtracting the running max overflows, even in float64."""
    q, k, v, tables, lens = random_pool([9, 30], 4, H=2, Hkv=1, D=8, seed=3)
    q = q * 400
    want = paged_decode_attention(q, k, v, tables, lens, 4, 1 / math.sqrt(8))
    got = solution.paged_decode(q, k, v, tables, lens, 4, 1 / math.sqrt(8))
    assert torch.isfinite(got).all(), "scores in the thousands overflowed exp: subtract the running max"
    torch.testing.assert_close(got, want, atol=1e-8, rtol=0)


def test_no_slot_outside_the_sequence_is_read(solution):
    """Every slot the sequences do not own holds NaN (the padding block 0, spare blocks, the unfilled tail of
    each last block): one read of them, even masked afterwards, turns the output into NaN."""
    for block_size in (1, 4, 16):
        poisoned_pool_check(solution, block_size)


def poisoned_pool_check(solution, block_size):
    lens = [1, 2 * block_size + 1, 23]
    q, k, v, tables, ctx = random_pool(lens, block_size, H=4, Hkv=2, D=8, seed=4)
    owned = torch.zeros(k.shape[0], dtype=torch.bool)
    for s, n in enumerate(lens):
        for p in range(n):
            owned[int(tables[s, p // block_size]) * block_size + p % block_size] = True
    want = paged_decode_attention(q, k, v, tables, ctx, block_size, 1 / math.sqrt(8))
    k[~owned], v[~owned] = float("nan"), float("nan")
    got = solution.paged_decode(q, k, v, tables, ctx, block_size, 1 / math.sqrt(8))
    assert not got.isnan().any(), "a slot the sequence does not own was read (padding, spare or unfilled)"
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_float32_and_bfloat16_pools_keep_their_dtype(solution):
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        check(solution, [5, 18], block_size=4, H=4, Hkv=2, dtype=dtype, seed=5, atol=atol)
