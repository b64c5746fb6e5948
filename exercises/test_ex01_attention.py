"""Grader for ex01_attention: attention with the mask. Reference: a float64 loop over every query and key."""

from __future__ import annotations

import math

import torch

EXERCISE = "ex01_attention"


def loop_reference(q, k, v, keep, causal):
    """One query at a time, one key at a time, in float64."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    out = torch.zeros(B, H, Tq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                seen = [j for j in range(Tk) if (not causal or j <= Tk - Tq + i) and (keep is None or keep[b, j])]
                if not seen:
                    continue
                scores = torch.tensor([float(q[b, h, i].double() @ k[b, h, j].double()) / math.sqrt(D) for j in seen],
                                      dtype=torch.float64)
                weights = torch.softmax(scores, dim=0)
                out[b, h, i] = sum(w * v[b, h, j].double() for w, j in zip(weights, seen, strict=True))
    return out


def check(solution, B=2, H=2, Tq=5, Tk=5, D=8, keep=None, causal=True):
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for T in (Tq, Tk, Tk))
    out = solution.attention(q, k, v, keep, causal)
    assert out.shape == (B, H, Tq, D), f"output shape {tuple(out.shape)}, expected {(B, H, Tq, D)}"
    expected = loop_reference(q, k, v, keep, causal)
    assert not torch.isnan(out).any(), "the output has NaN"
    err = (out - expected).abs().max().item()
    assert err <= 1e-10, f"max error {err:.3g} against the float64 loop (B={B} H={H} Tq={Tq} Tk={Tk} causal={causal})"


def test_no_mask_is_plain_softmax_attention(solution):
    check(solution, causal=False)


def test_causal_mask_square(solution):
    check(solution, causal=True)


def test_queries_sit_at_the_end_of_the_keys(solution):
    """Tq < Tk: cached decode and chunked prefill. Query i sees keys 0 .. Tk - Tq + i."""
    check(solution, Tq=1, Tk=6)
    check(solution, Tq=3, Tk=7)


def test_padding_mask_hides_padded_keys(solution):
    keep = torch.tensor([[False, False, True, True, True, True], [True] * 6])  # row 0 left-padded by 2
    check(solution, Tq=6, Tk=6, keep=keep)
    check(solution, Tq=6, Tk=6, keep=keep, causal=False)


def test_a_future_value_never_leaks(solution):
    """A huge value at a future key: filling masked scores with 0 instead of finfo.min lets it in."""
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.zeros(1, 1, 3, 4)
    v[0, 0, 2] = 1e6
    out = solution.attention(q, k, v, None, True)
    assert out[0, 0, :2].abs().max() < 1.0, "query 0 or 1 picked up the value of future key 2"


def test_a_query_that_sees_no_key_gives_zeros_not_nan(solution):
    keep = torch.tensor([[False, False, True, True]])  # queries 0 and 1 (causal) see only padding
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out = solution.attention(q, k, v, keep, True)
    assert not torch.isnan(out).any(), "NaN: was the mask filled with -inf? (-inf - (-inf) = NaN)"
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2])), "rows without a visible key must be 0"


def test_keeps_the_input_dtype(solution):
    q = torch.randn(1, 2, 4, 8, dtype=torch.float32)
    assert solution.attention(q, q, q, None, True).dtype == torch.float32
