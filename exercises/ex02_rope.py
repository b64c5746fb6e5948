"""Exercise (docs/02): rotary position embedding on q and k.

Fill in the three functions, then grade them:

    uv run pytest exercises/test_ex02_rope.py

The project's layout is "rotate-half": dimension i is paired with dimension i + D/2, and pair i turns by
the angle position * theta^(-2i/D). v is never rotated (docs/02 section 3), so apply_rope takes q and k only.
"""

from __future__ import annotations

import torch


def rope_tables(positions: torch.Tensor, d_head: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (T,) int64 -> cos, sin, each (T, D) float32, where column i and column i + D/2 both hold
    the angle positions[t] * theta^(-2i/D)."""
    # TODO 1: inv_freq = theta ** (-(0, 2, 4, ..., D - 2) / D)          (D/2,)
    # TODO 2: angles = positions[:, None] * inv_freq[None, :]             (T, D/2), in float32
    # TODO 3: repeat the angles for the second half: cat([angles, angles], -1), return cos and sin
    raise NotImplementedError("TODO: exercise ex02_rope, the cos/sin tables")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Split the last dim into halves (x1, x2) and return (-x2, x1): every pair turned by 90 degrees."""
    # TODO 4
    raise NotImplementedError("TODO: exercise ex02_rope, rotate_half")


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, T, D), k (B, Hkv, T, D), positions (T,) -> (q rotated, k rotated), same shapes and dtypes.

    x_rotated = x * cos + rotate_half(x) * sin, with the tables cast to x's dtype.
    """
    # TODO 5: tables for the positions, broadcast over batch and heads, rotate q and k
    raise NotImplementedError("TODO: exercise ex02_rope, apply_rope")
