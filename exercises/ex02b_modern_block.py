"""Exercise (docs/02b): the modern block's pieces: RMSNorm, SwiGLU with Llama's width rule, GQA.

Fill in the four functions, then grade them:

    uv run pytest exercises/test_ex02b_modern_block.py

Weights are in nn.Linear's layout: a (out, in) matrix W maps x to x @ W.T.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x (..., C), weight (C,) -> x / sqrt(mean(x^2 over C) + eps) * weight, same shape and dtype as x."""
    # TODO 1 (no mean subtracted, no bias: that is the difference from LayerNorm)
    raise NotImplementedError("TODO: exercise ex02b_modern_block, rms_norm")


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x (..., C); w_gate, w_up (d_ff, C); w_down (C, d_ff) -> w_down(silu(w_gate x) * w_up x), (..., C)."""
    # TODO 2: which branch goes through silu and which one only multiplies decides the result
    raise NotImplementedError("TODO: exercise ex02b_modern_block, swiglu")


def llama_ffn_size(d_model: int, multiple_of: int) -> int:
    """Llama's d_ff: two thirds of 4 * d_model (int), rounded UP to a multiple of multiple_of."""
    # TODO 3
    raise NotImplementedError("TODO: exercise ex02b_modern_block, llama_ffn_size")


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (B, H, T, D); k, v (B, Hkv, T, D) with H a multiple of Hkv; no mask, scale 1/sqrt(D).

    Query head h uses key/value head h // G, where G = H // Hkv (neighbouring query heads share one).
    Returns (B, H, T, D).
    """
    # TODO 4: pair every query head with the kv head of its group, then plain attention
    raise NotImplementedError("TODO: exercise ex02b_modern_block, gqa_attention")
