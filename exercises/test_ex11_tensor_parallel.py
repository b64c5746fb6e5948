"""Grader for exercise 11: the head ranges of a tensor-parallel W_qkv and a row-parallel sum, against
head-by-head enumeration and a float64 matrix product."""

from __future__ import annotations

import torch

EXERCISE = "ex11_tensor_parallel"


def rows_by_enumeration(H, Hkv, D, rank, W):
    """Every row this rank needs, listed head by head: its q heads and the kv heads those q heads read."""
    q_heads = [h for h in range(H) if h // (H // W) == rank]
    kv_heads = sorted({h // (H // Hkv) for h in q_heads})
    q = [h * D + d for h in q_heads for d in range(D)]
    k = [H * D + g * D + d for g in kv_heads for d in range(D)]
    v = [(H + Hkv) * D + g * D + d for g in kv_heads for d in range(D)]
    return q, k, v


def test_qkv_ranges_cover_exactly_the_heads_each_rank_needs(solution):
    for H, Hkv, D, W in ((4, 4, 3, 2), (8, 2, 2, 2), (8, 4, 2, 4), (6, 6, 1, 3)):
        seen = []
        for rank in range(W):
            ranges = solution.qkv_row_ranges(H, Hkv, D, rank, W)
            assert len(ranges) == 3, "three ranges: q, k, v"
            got = [list(range(a, b)) for a, b in ranges]
            want = rows_by_enumeration(H, Hkv, D, rank, W)
            for name, g, w in zip("qkv", got, want, strict=True):
                assert g == w, f"H={H} Hkv={Hkv} D={D} W={W} rank {rank}: {name} rows {g[:4]}..., expected {w[:4]}..."
            seen += [r for rows in got for r in rows]
        assert sorted(seen) == list(range((H + 2 * Hkv) * D)), "the ranks together hold every row exactly once"


def test_row_parallel_sum_equals_the_full_product(solution):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    bias = torch.randn(6, generator=gen, dtype=torch.float64)
    for W in (1, 2, 4):
        got = solution.row_parallel_sum(x, weight, bias, W)
        assert got.shape == (3, 5, 6), f"world_size {W}: shape {tuple(got.shape)}, expected (3, 5, 6)"
        assert torch.allclose(got, x @ weight.T + bias, atol=1e-10), f"world_size {W}: not x @ W.T + b"
        no_bias = solution.row_parallel_sum(x, weight, None, W)
        assert torch.allclose(no_bias, x @ weight.T, atol=1e-10), f"world_size {W}, no bias: not x @ W.T"
