"""Grader for ex04_online_softmax: online softmax over key blocks. Reference: the full softmax in float64."""

from __future__ import annotations

import math

import torch

EXERCISE = "ex04_online_softmax"


def full_reference(q, k, v):
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    return torch.softmax(scores, dim=-1) @ v.double(), torch.logsumexp(scores, dim=-1)


def check(solution, q, k, v, block_k, tol=1e-10):
    out, lse = solution.online_softmax_attention(q, k, v, block_k)
    expected_out, expected_lse = full_reference(q, k, v)
    assert out.shape == q.shape, f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}"
    assert lse.shape == q.shape[:-1], f"lse has shape {tuple(lse.shape)}, expected (B, H, Tq) = {tuple(q.shape[:-1])}"
    err = (out.double() - expected_out).abs().max().item()
    assert err <= tol, f"block_k={block_k}: out is {err:.3g} away from the full softmax (dropped the alpha rescale?)"
    err = (lse.double() - expected_lse).abs().max().item()
    assert err <= tol, f"block_k={block_k}: lse is {err:.3g} away from logsumexp of the scores"


def test_one_block_is_the_plain_softmax(solution):
    q, k, v = (torch.randn(2, 2, T, 8, dtype=torch.float64) for T in (5, 9, 9))
    check(solution, q, k, v, block_k=9)
    check(solution, q, k, v, block_k=100)


def test_any_block_size_gives_the_same_answer(solution):
    q, k, v = (torch.randn(1, 3, T, 16, dtype=torch.float64) for T in (7, 23, 23))
    for block_k in (1, 2, 5, 8, 22):
        check(solution, q, k, v, block_k)


def test_a_later_block_with_a_larger_maximum_rescales_the_earlier_sum(solution):
    """Block 2 holds the row's largest score: everything summed in block 1 must be scaled by alpha."""
    q = torch.ones(1, 1, 1, 4, dtype=torch.float64)
    k = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    k[..., 2:, :] = 3.0  # keys 2, 3 score 6, keys 0, 1 score 0
    v = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    check(solution, q, k, v, block_k=2)


def test_large_scores_do_not_overflow(solution):
    """Scores near 1000: exp(1000) is inf; subtracting the running maximum keeps every exponent <= 0."""
    q = torch.full((1, 1, 2, 4), 20.0)
    k = torch.randn(1, 1, 6, 4) + 25.0
    v = torch.randn(1, 1, 6, 4)
    out, lse = solution.online_softmax_attention(q, k, v, block_k=2)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), "overflow: subtract the running maximum"
    check(solution, q.double(), k.double(), v.double(), block_k=2)


def test_keeps_the_input_dtype(solution):
    q = torch.randn(1, 1, 3, 8, dtype=torch.float32)
    out, lse = solution.online_softmax_attention(q, q, q, block_k=2)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
