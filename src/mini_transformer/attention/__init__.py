"""One attention function, several backends, one mask meaning.

    out = attention(q, k, v, causal=True, key_padding_mask=keep, backend="naive")

q (B, H, Tq, D); k, v (B, Hkv, Tk, D) with H a multiple of Hkv (GQA/MQA); keep (B, Tk) bool,
True = a real key. Masks mean "True = may attend" everywhere. Queries shorter than keys sit at
the END of the key sequence: query i has absolute position Tk - Tq + i, so prefill (Tq == Tk) and
cached decode (Tq == 1) are the same code. A query that can see no key at all returns zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .._checks import choice, probability
from .mask import build_mask, causal_mask
from .naive import naive_attention
from .paged import PagedAttention, PagedAttentionMetadata, paged_attention_for, write_kv
from .sdpa import sdpa_attention
from .tiled import check_tiled, tiled_attention

BACKENDS = ("naive", "sdpa", "tiled", "triton")

__all__ = ["BACKENDS", "PagedAttention", "PagedAttentionMetadata", "attention", "build_mask", "causal_mask",
           "check_attention_inputs", "check_backend", "get_backend", "paged_attention_for", "write_kv"]


def check_attention_inputs(q, k, v, key_padding_mask, dropout_p) -> None:
    """Raise a clear error for inputs no backend can handle."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (B, heads, T, D), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    B, H, Tq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in batch or head dim")
    Hkv, Tk = k.shape[1], k.shape[2]
    if H % Hkv != 0:
        raise ValueError(f"q has H={H} heads, k/v have Hkv={Hkv}; H must be a multiple of Hkv")
    if Tq > Tk:
        raise ValueError(f"q has Tq={Tq} positions but k has only Tk={Tk}; queries must satisfy Tq <= Tk")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool tensor (True = real key)")
        if tuple(key_padding_mask.shape) != (B, Tk):
            raise ValueError(
                f"key_padding_mask has shape {tuple(key_padding_mask.shape)}, expected (B, Tk) = {(B, Tk)}"
            )
    probability("dropout_p", dropout_p, one=False)


def check_backend(name: str, dtype: torch.dtype, head_dim: int, device: torch.device, dropout_p: float) -> None:
    """What a backend cannot run (tiled and triton: no dropout; triton: its dtypes, head sizes, devices),
    checked once where the backend meets its inputs: attention(), and the doors of the model, generate,
    the engine and training. The backend functions themselves run in every layer and trust their inputs."""
    if name == "tiled":
        check_tiled(dropout_p)
    elif name == "triton":
        from .triton_flash import check_triton

        check_triton(dtype, head_dim, device, dropout_p=dropout_p)


def get_backend(name: str) -> Callable:
    """The function behind `backend=name`; each takes (q, k, v, *, causal, key_padding_mask, dropout_p,
    scale) and trusts its inputs (`attention()` checks them; the model resolves its backend once)."""
    choice("backend", name, BACKENDS)
    if name == "triton":  # imported on demand: it needs the triton package, and importing it is slow
        from .triton_flash import triton_attention

        return triton_attention
    return {"naive": naive_attention, "sdpa": sdpa_attention, "tiled": tiled_attention}[name]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "naive",
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, computed by the chosen backend. Returns (B, H, Tq, D)."""
    fn = get_backend(backend)
    check_attention_inputs(q, k, v, key_padding_mask, dropout_p)
    check_backend(backend, q.dtype, q.shape[-1], q.device, dropout_p)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return fn(q, k, v, causal=causal, key_padding_mask=key_padding_mask, dropout_p=dropout_p, scale=scale)
