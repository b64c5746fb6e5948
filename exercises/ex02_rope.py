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
    # TODO 1: one rotation speed per pair of columns, as the docstring's formula gives it    (D/2,)
    # TODO 2: the angle of every (position, pair), computed in float32                      (T, D/2)
    # TODO 3: lay the angles out so that columns i and i + D/2 (one pair) share an angle; cos and sin
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
    # TODO 5: rotate q and k (never v) by their positions' angles, whatever the number of heads
    raise NotImplementedError("TODO: exercise ex02_rope, apply_rope")
