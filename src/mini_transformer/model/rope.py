"""Rotary position embedding (RoPE): rotate each (x_i, x_{i+D/2}) pair of q and k by an angle
proportional to the token's position. Applied to q and k only, never to v.

Layout: "rotate-half" (the Hugging Face Llama layout): dimension i is paired with i + D/2.
The other common layout pairs neighbours (2i, 2i+1); the two are the same rotation after a fixed
permutation of the q/k projection rows (docs/02-rope.md).
"""

from __future__ import annotations

import torch
import torch.nn as nn


def rope_tables(max_seq_len: int, d_head: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_seq_len, d_head), angle[t, i] = t * theta^(-2i/D)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)  # (D/2,)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D): pair i and i + D/2 share an angle
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim: a 90-degree turn of every pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D); cos, sin (B or 1, 1, T, D). Returns x rotated, same shape and dtype."""
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin tables as non-persistent buffers (recomputable, so not in the state_dict)."""

    def __init__(self, d_head: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        cos, sin = rope_tables(max_seq_len, d_head, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (B, T) -> cos, sin (B, 1, T, D) in `dtype`, ready to broadcast over heads."""
        return self.cos[position_ids][:, None].to(dtype), self.sin[position_ids][:, None].to(dtype)


def sinusoidal_table(max_seq_len: int, d_model: int) -> torch.Tensor:
    """The 2017 paper's fixed positions: pe[t, 2i] = sin(t / 10000^(2i/C)), pe[t, 2i+1] = cos(...)."""
    position = torch.arange(max_seq_len, dtype=torch.float32)[:, None]  # (T, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float32) / d_model)  # (C/2,)
    table = torch.zeros(max_seq_len, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)
    return table  # (T, C)
