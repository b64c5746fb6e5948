"""Mask helpers. One meaning everywhere: True = this query may attend to this key."""

from __future__ import annotations

import torch


def causal_mask(Tq: int, Tk: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(Tq, Tk) bool. Queries sit at the end of the keys: query i may see keys 0 .. Tk - Tq + i."""
    return torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril(diagonal=Tk - Tq)


def build_mask(
    Tq: int,
    Tk: int,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """Combine causal and padding masks with `&`. Returns (B or 1, 1, Tq, Tk) bool, or None if nothing is masked."""
    mask = None
    if causal:
        mask = causal_mask(Tq, Tk, device)[None, None]  # (1, 1, Tq, Tk)
    if key_padding_mask is not None:
        keep = key_padding_mask[:, None, None, :]  # (B, 1, 1, Tk)
        mask = keep if mask is None else mask & keep
    return mask
