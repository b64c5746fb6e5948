"""The reference: scores -> masked_fill(finfo.min) -> softmax -> dropout -> @ v, every matrix explicit."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mask import build_mask


def attention_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, H, Tq, D), k (B, Hkv, Tk, D) -> scores (B, Hkv, G, Tq, Tk) with G = H // Hkv.

    Query heads are grouped by the key/value head they share (head h uses kv head h // G), so GQA
    broadcasts k instead of copying it G times.
    """
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    q = q.view(B, Hkv, H // Hkv, Tq, D)  # (B, Hkv, G, Tq, D)
    return (q @ k.unsqueeze(2).transpose(-2, -1)) * scale  # (B, Hkv, G, Tq, Tk)


def attention_weights(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax over keys. Masked scores get finfo.min (not 0: softmax(0) is not 0), and a row with
    no visible key gets all-zero weights instead of a uniform spread over padding."""
    if mask is None:
        return torch.softmax(scores, dim=-1)
    mask = mask.unsqueeze(2)  # (B|1, 1, 1, Tq, Tk): broadcast over the group dim
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)


def naive_attention(q, k, v, *, causal, key_padding_mask, dropout_p, scale) -> torch.Tensor:
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    mask = build_mask(Tq, Tk, causal=causal, key_padding_mask=key_padding_mask, device=q.device)
    weights = attention_weights(attention_scores(q, k, scale), mask)  # (B, Hkv, G, Tq, Tk)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    out = weights @ v.unsqueeze(2)  # (B, Hkv, G, Tq, D)
    return out.reshape(B, H, Tq, D)
