"""Grader for ex03_top_p: top-p. Reference: walk the sorted probabilities one token at a time, in float64."""

from __future__ import annotations

import math

import torch

EXERCISE = "ex03_top_p"


def kept_by_loop(logits_row, top_p):
    probs = torch.softmax(logits_row.double(), dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda j: -probs[j])
    kept, mass = set(), 0.0
    for j in order:
        kept.add(j)
        mass += probs[j]
        if mass >= top_p:
            break
    return kept


def kept(solution, logits, top_p):
    out = solution.top_p_filter(logits.clone(), top_p)
    assert out.shape == logits.shape, f"output shape {tuple(out.shape)}, expected {tuple(logits.shape)}"
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite]), "kept logits must be unchanged"
    assert torch.isneginf(out[~finite]).all(), "dropped tokens must be -inf"
    return [set(torch.nonzero(row).flatten().tolist()) for row in finite]


def test_hand_made_distribution(solution):
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]])  # ranked: token 1 (0.4), 3 (0.3), 2 (0.2), 0 (0.1)
    logits = probs.log()
    for top_p, expected in ((0.35, {1}), (0.65, {1, 3}), (0.85, {1, 3, 2}), (0.95, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})):
        assert kept(solution, logits, top_p) == [expected], f"top_p={top_p}: keep {sorted(expected)}"


def test_the_token_that_crosses_top_p_is_kept(solution):
    logits = torch.tensor([[math.log(0.6), math.log(0.4)]])
    assert kept(solution, logits, 0.7) == [{0, 1}], "0.6 < 0.7: the 0.4 token crosses top_p and is kept"


def test_the_most_likely_token_is_always_kept(solution):
    logits = torch.randn(4, 50)
    for row, top in zip(kept(solution, logits, 1e-6), logits.argmax(-1).tolist(), strict=True):
        assert row == {top}, "a tiny top_p keeps exactly the most likely token"


def test_rows_are_filtered_independently_and_match_the_loop(solution):
    logits = torch.randn(6, 40) * 3
    for top_p in (0.3, 0.8, 0.95):
        got = kept(solution, logits, top_p)
        for b in range(6):
            assert got[b] == kept_by_loop(logits[b], top_p), f"row {b}, top_p={top_p}"
