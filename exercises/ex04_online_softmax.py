"""Exercise (docs/04): attention over blocks of keys with the online softmax (the FlashAttention forward).

Fill in `online_softmax_attention`, then grade it:

    uv run pytest exercises/test_ex04_online_softmax.py

Never build the (Tq, Tk) score matrix: walk the keys block_k at a time and keep, per query row,
the running maximum m, the running denominator l and the running numerator acc (docs/04 section 2):

    s     = q k_j^T * scale                (.., Tq, bk)
    m_new = max(m, rowmax(s))
    p     = exp(s - m_new)
    alpha = exp(m - m_new)                 rescales what was summed under the old maximum
    l     = alpha * l + rowsum(p)
    acc   = alpha * acc + p v_j
    m     = m_new
    at the end: out = acc / l,  lse = m + log(l)
"""

from __future__ import annotations

import torch


def online_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Tq, D), k and v (B, H, Tk, D), no mask. scale = 1 / sqrt(D).

    Returns out (B, H, Tq, D) = softmax(q k^T * scale) v and lse (B, H, Tq), the log-sum-exp of each
    row of scores, both in q's dtype.
    """
    # TODO 1: the running state of every query row before any key has been seen
    # TODO 2: visit the keys block_k at a time (the last block may be shorter), folding each into the state
    # TODO 3: from the final state, the normalised output and each row's log-sum-exp
    raise NotImplementedError("TODO: exercise ex04_online_softmax, online softmax over key blocks")
