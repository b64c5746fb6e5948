"""Grader for ex09_moe_router: routing and the load-balancing loss, against loops over tokens in float64."""

from __future__ import annotations

import torch

EXERCISE = "ex09_moe_router"


def test_route_keeps_the_full_softmax_probabilities(solution):
    logits = torch.randn(6, 5)
    weights, experts = solution.route(logits, 2, renormalize=False)
    assert weights.shape == experts.shape == (6, 2), f"shapes {tuple(weights.shape)}, {tuple(experts.shape)}"
    probs = torch.softmax(logits.double(), dim=-1)
    for n in range(6):
        best = sorted(range(5), key=lambda e: -probs[n, e].item())[:2]
        assert set(experts[n].tolist()) == set(best), f"token {n}: the two most likely experts are {best}"
        for w, e in zip(weights[n].tolist(), experts[n].tolist(), strict=True):
            assert abs(w - probs[n, e].item()) < 1e-6, "weights are the softmax over ALL experts, not over the k"


def test_renormalized_weights_sum_to_one(solution):
    logits = torch.randn(8, 6)
    weights, experts = solution.route(logits, 3, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(8), atol=1e-6), "renormalized: the k weights sum to 1"
    raw, raw_experts = solution.route(logits, 3, renormalize=False)
    assert torch.equal(experts, raw_experts), "renormalizing must not change which experts are chosen"
    assert torch.allclose(weights, raw / raw.sum(-1, keepdim=True), atol=1e-6)


def loss_reference(logits, k):
    N, E = logits.shape
    probs = torch.softmax(logits.double(), dim=-1)
    counts = [0] * E
    for n in range(N):
        for e in torch.topk(probs[n], k).indices.tolist():
            counts[e] += 1
    return E * sum(counts[e] / (N * k) * probs[:, e].mean() for e in range(E))


def test_loss_matches_the_formula(solution):
    for k in (1, 2):
        logits = torch.randn(10, 4, dtype=torch.float64)
        got = solution.load_balancing_loss(logits, k)
        assert abs(float(got) - float(loss_reference(logits, k))) < 1e-6, f"k={k}: E * sum_e f_e * P_e"


def test_loss_is_one_when_balanced_and_larger_when_not(solution):
    balanced = torch.eye(4) * 5.0  # token i prefers expert i, equally sure: f and P both uniform
    assert abs(float(solution.load_balancing_loss(balanced, 1)) - 1.0) < 1e-6, "a balanced router scores exactly 1"
    crowded = torch.zeros(4, 4)
    crowded[:, 0] = 5.0  # every token prefers expert 0
    assert float(solution.load_balancing_loss(crowded, 1)) > 2.0, "sending everyone to one expert costs more"


def test_the_gradient_flows_through_the_probabilities_only(solution):
    logits = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    solution.load_balancing_loss(logits, 2).backward()
    probs = torch.softmax(logits.detach(), dim=-1).requires_grad_(False)
    counts = torch.zeros(4, dtype=torch.float64).scatter_add_(0, probs.topk(2, -1).indices.reshape(-1),
                                                              torch.ones(12, dtype=torch.float64))
    f = counts / 12  # a constant: counting has no gradient
    reference = logits.detach().clone().requires_grad_(True)
    (4 * (f * torch.softmax(reference, dim=-1).mean(0)).sum()).backward()
    assert torch.allclose(logits.grad, reference.grad, atol=1e-6), "the gradient of E * sum_e f_e * P_e, f fixed"
