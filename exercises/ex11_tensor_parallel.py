"""Exercise 11 (docs/10 section 3): Megatron's split of an attention layer, simulated in one process.

Fill in `qkv_row_ranges` and `row_parallel_sum`, then grade them:

    uv run pytest exercises/test_ex11_tensor_parallel.py
"""

from __future__ import annotations

import torch


def qkv_row_ranges(n_heads: int, n_kv_heads: int, d_head: int, rank: int, world_size: int) -> list[tuple[int, int]]:
    """The rows of the fused W_qkv that `rank` keeps, as [q_range, k_range, v_range], each (start, stop).

    W_qkv has (H + 2 Hkv) * D rows: H query heads, then Hkv key heads, then Hkv value heads, D rows each.
    Rank r keeps the contiguous query heads [r*H/W, (r+1)*H/W) and the key and value heads they read:
    query head h reads kv head h // (H / Hkv), so those are [r*Hkv/W, (r+1)*Hkv/W).
    """
    # TODO 1: the q range, counted from row 0
    # TODO 2: the k and v ranges: the k block starts after all H*D query rows, the v block after the k block
    raise NotImplementedError("TODO: exercise 11, qkv_row_ranges")


def row_parallel_sum(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, world_size: int) -> torch.Tensor:
    """What W ranks of a row-parallel linear layer compute together: y = x @ weight.T + bias.

    weight (out, in) is split by its INPUT features into world_size equal column blocks; rank r sees only
    x's matching slice of features and computes a partial output x_r @ W_r.T (out features, all of them).
    The all_reduce adds the partial outputs; the bias is added once, after the sum.
    """
    # TODO 3: the partial output of each rank (split x and weight along the input features)
    # TODO 4: their sum (what dist.all_reduce would leave on every rank), then the bias, once
    raise NotImplementedError("TODO: exercise 11, row_parallel_sum")
