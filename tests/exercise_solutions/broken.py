"""The "break it" experiments of the docs pages, as wrong answers each grader must reject."""

from __future__ import annotations

import math
import types

import torch

from . import ex2_rope


def _attention_filling(value):
    def attention(q, k, v, keep=None, causal=True):
        Tq, Tk = q.shape[2], k.shape[2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
        allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)[None, None]
        if keep is not None:
            allowed = allowed & keep[:, None, None, :]
        fill = torch.finfo(scores.dtype).min if value == "finfo.min" else value
        weights = torch.softmax(scores.masked_fill(~allowed, fill), dim=-1)
        return weights @ v

    return attention


def _rope_interleaved_pairs(q, k, positions, theta=10000.0):
    """Pairs (2i, 2i+1) instead of the project's (i, i + D/2): a rotation, but of the wrong pairs."""
    def turn(x):
        D = x.shape[-1]
        angles = positions[:, None].double() * theta ** (-torch.arange(0, D, 2).double() / D)  # (T, D/2)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)

    return turn(q), turn(k)


def _online_softmax_without_alpha(q, k, v, block_k):
    scale = 1.0 / math.sqrt(q.shape[-1])
    m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for j in range(0, k.shape[2], block_k):
        s = q @ k[:, :, j:j + block_k].transpose(-2, -1) * scale
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        l = l + p.sum(-1, keepdim=True)  # the bug: no alpha * l
        acc = acc + p @ v[:, :, j:j + block_k]  # the bug: no alpha * acc
        m = m_new
    return acc / l, (m + torch.log(l)).squeeze(-1)


BROKEN = {
    "ex1_attention": {
        "masked scores filled with 0": types.SimpleNamespace(attention=_attention_filling(0.0)),
        "masked scores filled with -inf": types.SimpleNamespace(attention=_attention_filling(float("-inf"))),
        "masked weights not zeroed after softmax": types.SimpleNamespace(attention=_attention_filling("finfo.min")),
    },
    "ex2_rope": {
        "neighbouring pairs (2i, 2i+1)": types.SimpleNamespace(
            rope_tables=ex2_rope.rope_tables, rotate_half=ex2_rope.rotate_half, apply_rope=_rope_interleaved_pairs),
    },
    "ex3_online_softmax": {
        "alpha rescale dropped": types.SimpleNamespace(online_softmax_attention=_online_softmax_without_alpha),
    },
}
