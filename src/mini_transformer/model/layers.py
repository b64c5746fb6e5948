"""Norms and feed-forward networks: the per-token parts of a block (they never mix positions)."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import TransformerConfig
from .fused_ops import rms_norm, silu_mul


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight: LayerNorm without centring and without a bias.

    Computed in float32 (as Llama does) and cast back, so bf16 activations keep their scale; the
    output has the input's dtype even when the weight is float32 (bf16 activations, fp32 master weights).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # one pass on the CPU at inference (fused_ops.py)


class MLP(nn.Module):
    """The classic FFN: d_model -> d_ff -> activation -> d_model, applied to each token alone."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        if cfg.ffn == "relu":
            self.activation = nn.ReLU()
        else:  # "gelu" is the exact erf form; "gelu_tanh" is GPT-2's approximation
            self.activation = nn.GELU(approximate="tanh" if cfg.ffn == "gelu_tanh" else "none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))  # (B, T, C) -> (B, T, d_ff) -> (B, T, C)


class SwiGLU(nn.Module):
    """Llama's gated FFN: w_down(silu(w_gate x) * w_up x). The gate decides, per hidden unit,
    how much of the linear "up" path passes."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.w_up = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.w_down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(silu_mul(self.w_gate(x), self.w_up(x)))  # (B, T, d_ff) -> (B, T, C)
