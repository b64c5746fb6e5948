"""Grader for ex08_int8_speculative: int8 against float64 row maxima and the half-step bound; the acceptance rule by
chi-square tests on its output (false-alarm rate 1e-6 each: a right answer fails one seed in a million)
and by cases whose answer is certain."""

from __future__ import annotations

import torch

EXERCISE = "ex08_int8_speculative"
ALPHA = 1e-6


def rows_of_different_sizes() -> torch.Tensor:
    w = torch.randn(6, 40, dtype=torch.float64)
    return (w * torch.tensor([1e3, 1.0, 1e-3, 5.0, 1e-6, 0.0], dtype=torch.float64)[:, None]).float()  # (6, 40)


def test_int8_scales_are_per_row_and_the_full_range_is_used(solution):
    w = rows_of_different_sizes()
    q, scales = solution.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape, f"q: {q.dtype}, {tuple(q.shape)}"
    assert scales.shape == (6,), f"one scale per output row: got shape {tuple(scales.shape)}"
    want = w.double().abs().amax(dim=1) / 127
    assert torch.allclose(scales[:5].double(), want[:5], rtol=1e-6), "scale of row n = max |w[n]| / 127"
    assert q[:5].abs().amax(dim=1).tolist() == [127] * 5, "symmetric: each row's largest |w| maps to 127"
    assert torch.isfinite(scales).all() and (q[5] == 0).all(), "a row of zeros: no division by zero"


def test_int8_error_is_at_most_half_a_step_in_every_row(solution):
    w = rows_of_different_sizes()
    q, scales = solution.quantize_int8(w)
    w_hat = solution.dequantize_int8(q, scales)
    step = w.double().abs().amax(dim=1, keepdim=True) / 127  # (6, 1): each row's own step
    error = (w_hat.double() - w.double()).abs()
    assert (error <= step / 2 * (1 + 1e-5) + 1e-30).all(), (
        "|w - w_hat| <= s[n] / 2 per row; worst ratio to the half step: "
        f"{float((error / (step / 2).clamp(min=1e-30)).max()):.3g}")


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs (cells with expected count < 5 pooled into one)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    statistic = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor((len(exp) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))


def first_tokens(solution, p, q, trials, gen):
    """How often each token comes out first, over `trials` rounds of one draft d ~ q[0]."""
    counts = torch.zeros(p.shape[-1])
    for _ in range(trials):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        n_accepted, nxt = solution.accept_drafts(p, q, [d], gen)
        counts[d if n_accepted == 1 else nxt] += 1
    return counts


def test_the_output_follows_the_target_whatever_the_drafter(solution):
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])  # (k+1, V), k = 1
    for q in (torch.tensor([[0.1, 0.1, 0.2, 0.6]]), torch.tensor([[0.7, 0.1, 0.1, 0.1]])):
        counts = first_tokens(solution, p, q, 3000, gen)
        assert chi_square_p_value(counts, p[0]) > ALPHA, (
            f"drafter {q[0].tolist()}: first tokens {counts.tolist()} of 3000 do not follow p = {p[0].tolist()}")


def test_after_a_rejection_the_token_comes_from_the_normalised_residual(solution):
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.2, 0.2, 0.6], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.8, 0.1, 0.1]])  # draft token 0: accepted with probability 0.2 / 0.8
    residual = (p[0] - q[0]).clamp(min=0)
    counts = torch.zeros(3)
    for _ in range(2000):
        n_accepted, nxt = solution.accept_drafts(p, q, [0], gen)
        if n_accepted == 0:
            counts[nxt] += 1
    assert counts[0] == 0, "max(p - q, 0) is 0 for the rejected draft: it can never be drawn again"
    assert chi_square_p_value(counts, residual / residual.sum()) > ALPHA, (
        f"after a rejection: {counts.tolist()}, want max(p - q, 0) normalised = {(residual / residual.sum()).tolist()}")


def test_certain_cases(solution):
    gen = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(4, 6, generator=gen), dim=-1)
    n_accepted, nxt = solution.accept_drafts(p, p[:3].clone(), [1, 4, 2], gen)
    assert n_accepted == 3 and 0 <= nxt < 6, "a drafter equal to the target is always accepted (p / q = 1)"
    zero = p.clone()
    zero[1, 4] = 0.0
    zero[1] /= zero[1].sum()
    for _ in range(20):
        n_accepted, nxt = solution.accept_drafts(zero, p[:3].clone(), [1, 4, 2], gen)
        assert n_accepted <= 1 and (n_accepted == 0 or nxt != 4), "a draft the target gives p = 0 is never kept"
    one_hot = torch.eye(6)[[2, 5, 0]]  # greedy: p and q one-hot; a draft survives iff it is the target's argmax
    assert solution.accept_drafts(one_hot, torch.eye(6)[[2, 3]], [2, 3], gen) == (1, 5), (
        "greedy: draft 2 matches the target's argmax and is kept, draft 3 is rejected and replaced by 5")
