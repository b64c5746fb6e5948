"""PyTorch's fused scaled_dot_product_attention (flash / memory-efficient / math kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mask import build_mask


def sdpa_attention(q, k, v, *, causal, key_padding_mask, dropout_p, scale) -> torch.Tensor:
    Tq, Tk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if key_padding_mask is None and (not causal or Tq == Tk or Tq == 1):
        # No dense mask needed: lets PyTorch pick its flash kernel. (is_causal is top-left aligned,
        # which equals our end-aligned rule only when Tq == Tk; a single query at the end, as in
        # cached decode, sees every key, so it needs no mask at all.)
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal and Tq > 1, scale=scale, enable_gqa=gqa
        )
    mask = build_mask(Tq, Tk, causal=causal, key_padding_mask=key_padding_mask, device=q.device)
    # A row that sees no key would be softmax over nothing (NaN). Let it see every key instead,
    # then zero its output: the result is exact zeros and no NaN reaches the backward pass.
    has_key = mask.any(dim=-1, keepdim=True)  # (B|1, 1, Tq, 1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask | ~has_key, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )
    return out.masked_fill(~has_key, 0.0)
