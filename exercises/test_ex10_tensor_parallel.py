"""Grader for ex10_tensor_parallel: the shards against slices written out element by element, the simulated MLP
against the unsplit float64 product, and W_qkv's rows against a loop over heads."""

from __future__ import annotations

import torch

EXERCISE = "ex10_tensor_parallel"


def test_column_and_row_shards(solution):
    w, b = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    for world in (1, 2, 3):
        cols, rows = [], []
        for rank in range(world):
            w_r, b_r = solution.column_shard(w, b, rank, world)
            assert w_r.shape == (6 // world, 4), f"column shard: (out/W, in), got {tuple(w_r.shape)}"
            for i in range(6 // world):
                assert torch.equal(w_r[i], w[rank * (6 // world) + i]), f"rank {rank}: row {i} of its shard"
                assert b_r[i] == b[rank * (6 // world) + i], f"rank {rank}: its bias entries follow its rows"
            cols.append(w_r)
            rows.append(solution.row_shard(w.T, rank, world))
        assert torch.equal(torch.cat(cols), w), "the column shards, stacked, give w back"
        assert torch.equal(torch.cat(rows, dim=1), w.T), "the row shards, side by side, give w back"
    assert solution.column_shard(w, None, 1, 2)[1] is None


def mlp(x, w1, b1, w2, b2):
    return torch.nn.functional.gelu(x @ w1.T + b1) @ w2.T + b2


def test_the_partial_outputs_add_up_to_the_full_mlp(solution):
    torch.manual_seed(0)
    x = torch.randn(5, 8, dtype=torch.float64)
    w1, b1 = torch.randn(12, 8, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    w2, b2 = torch.randn(8, 12, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    want = mlp(x, w1, b1, w2, b2)
    for world in (1, 2, 4):
        y, partials = solution.tp_mlp(x, w1, b1, w2, b2, world)
        assert len(partials) == world and all(p.shape == (5, 8) for p in partials), "one (T, C) partial per rank"
        assert torch.allclose(y, want, atol=1e-10), f"world {world}: sum of partials + b2 != the unsplit MLP"
        for rank, partial in enumerate(partials):
            hidden = slice(rank * 12 // world, (rank + 1) * 12 // world)
            own = torch.nn.functional.gelu(x @ w1[hidden].T + b1[hidden]) @ w2[:, hidden].T
            assert torch.allclose(partial, own, atol=1e-10), f"rank {rank}: its hidden units only, no b2"


def rows_by_loop(H, Hkv, D, rank, world):
    rows = []
    for h in range(rank * H // world, (rank + 1) * H // world):
        rows += [h * D + i for i in range(D)]
    for offset in (H * D, (H + Hkv) * D):  # k heads, then v heads
        for h in range(rank * Hkv // world, (rank + 1) * Hkv // world):
            rows += [offset + h * D + i for i in range(D)]
    return rows


def test_qkv_rows_keep_whole_heads_and_whole_gqa_groups(solution):
    for H, Hkv, D, world in ((4, 4, 3, 2), (4, 2, 2, 2), (8, 2, 2, 2), (6, 3, 1, 3)):
        for rank in range(world):
            got = solution.qkv_shard_rows(H, Hkv, D, rank, world)
            want = rows_by_loop(H, Hkv, D, rank, world)
            assert got.tolist() == want, f"H={H}, Hkv={Hkv}, D={D}, rank {rank}/{world}: rows {got.tolist()}"
        every = sorted(r for rank in range(world) for r in solution.qkv_shard_rows(H, Hkv, D, rank, world).tolist())
        assert every == list(range((H + 2 * Hkv) * D)), "the ranks together hold every row exactly once"
