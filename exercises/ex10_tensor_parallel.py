"""Exercise (docs/10): Megatron's tensor-parallel split, simulated with W shards in one process.

Fill in `column_shard`, `row_shard`, `tp_mlp` and `qkv_shard_rows`, then grade them:

    uv run pytest exercises/test_ex10_tensor_parallel.py

An MLP y = gelu(x @ w1^T + b1) @ w2^T + b2, with w1 (F, C) and w2 (C, F), is split over W ranks so that
only ONE collective is needed:
  * w1 column-parallel: rank r keeps the output features (rows of w1, entries of b1) [r F/W, (r+1) F/W);
    it computes its own slice of the hidden units, gelu included, with no communication;
  * w2 row-parallel: rank r keeps the matching input features (columns of w2); its product is a partial
    sum of the full output, and an all_reduce (here: a plain sum over the shards) adds them up;
  * b2 is added once, after the sum.
Attention is split the same way by heads; W_qkv is fused (rows: all q heads, then k heads, then v heads),
so a rank's rows are three separate pieces of it.
"""

from __future__ import annotations

import torch


def column_shard(w: torch.Tensor, b: torch.Tensor | None, rank: int, world: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w (out, in), b (out,) or None -> rank's (w (out/W, in), b (out/W,) or None): its output features."""
    # TODO 1: this rank's equal share of the OUTPUT features, weight and bias alike
    raise NotImplementedError("TODO: exercise ex10_tensor_parallel, column_shard")


def row_shard(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """w (out, in) -> rank's (out, in/W): its input features (columns)."""
    # TODO 2: this rank's equal share of the INPUT features
    raise NotImplementedError("TODO: exercise ex10_tensor_parallel, row_shard")


def tp_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
           world: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x (T, C) -> (y (T, C), partials): each rank's partial output (T, C), without b2, and y = their sum + b2.
    gelu is torch.nn.functional.gelu (the exact, erf form)."""
    # TODO 3: each rank runs the MLP on its shards alone, with no communication, up to a partial output
    # TODO 4: combine the partials into the full MLP's output, as all_reduce would; mind the last bias
    raise NotImplementedError("TODO: exercise ex10_tensor_parallel, tp_mlp")


def qkv_shard_rows(n_heads: int, n_kv_heads: int, d_head: int, rank: int, world: int) -> torch.Tensor:
    """The rows of the fused W_qkv ((n_heads + 2 n_kv_heads) * d_head rows) that rank keeps, in order:
    its n_heads/W q heads, then its n_kv_heads/W k heads, then the same v heads, as a LongTensor.

    Rank r keeps q heads [r H/W, (r+1) H/W) and kv heads [r Hkv/W, (r+1) Hkv/W): with GQA, q head h reads
    kv head h // (H / Hkv), so each rank's q heads find the kv heads they read on the same rank."""
    # TODO 5: this rank's heads in each of the three sections of the fused weight, each head whole
    raise NotImplementedError("TODO: exercise ex10_tensor_parallel, qkv_shard_rows")
