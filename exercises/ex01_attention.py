"""Exercise (docs/01): scaled dot-product attention with the causal mask and the padding mask.

Fill in the body of `attention`, then grade it:

    uv run pytest exercises/test_ex01_attention.py

The rules are the project's (docs/01 section 4):
- scores = q k^T / sqrt(D);
- True = may attend, everywhere. Query i may see key j when the causal rule allows it AND key j is real;
- queries shorter than keys sit at the END of the keys: query i has absolute position Tk - Tq + i and
  may see keys 0 .. Tk - Tq + i;
- a masked score is set to torch.finfo(dtype).min before the softmax (not 0, and not -inf);
- a query that sees no key at all returns a row of zeros, never NaN.
"""

from __future__ import annotations

import torch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None,
              causal: bool = True) -> torch.Tensor:
    """q (B, H, Tq, D); k, v (B, H, Tk, D) with Tq <= Tk; keep (B, Tk) bool, True = a real key, or None.

    Returns (B, H, Tq, D) in q's dtype.
    """
    # TODO 1: the scaled score of every query against every key                        (B, H, Tq, Tk)
    # TODO 2: which keys each query may see: none after its own position (the queries are the LAST Tq of
    #         the Tk positions) and no padding key
    # TODO 3: turn the scores into weights over the visible keys only, without NaN; a query that sees no
    #         key at all gets weight 0 everywhere
    # TODO 4: mix the values with those weights                                          (B, H, Tq, D)
    raise NotImplementedError("TODO: exercise ex01_attention, attention with the mask")
