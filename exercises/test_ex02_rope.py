"""Grader for ex02_rope: RoPE on q and k. Reference: each (i, i + D/2) pair turned by an explicit 2x2 matrix."""

from __future__ import annotations

import math

import torch

EXERCISE = "ex02_rope"


def rotate_pairs_reference(x, positions, theta):
    """x (B, H, T, D) float64; pair (i, i + D/2) of position m turned by m * theta^(-2i/D), one pair at a time."""
    D = x.shape[-1]
    out = x.clone()
    for t, m in enumerate(positions.tolist()):
        for i in range(D // 2):
            angle = m * theta ** (-2 * i / D)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[..., t, i], x[..., t, i + D // 2]
            out[..., t, i], out[..., t, i + D // 2] = c * a - s * b, s * a + c * b
    return out


def test_tables_hold_position_times_frequency(solution):
    positions = torch.tensor([0, 1, 5, 17])
    cos, sin = solution.rope_tables(positions, 8, 10000.0)
    assert cos.shape == sin.shape == (4, 8), f"tables have shape {tuple(cos.shape)}, expected (T, D) = (4, 8)"
    inv_freq = torch.tensor([10000.0 ** (-2 * i / 8) for i in range(4)], dtype=torch.float64)
    angles = positions[:, None].double() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    assert torch.allclose(cos.double(), angles.cos(), atol=1e-5), "cos: columns i, i + D/2 hold m * theta^(-2i/D)"
    assert torch.allclose(sin.double(), angles.sin(), atol=1e-5), "sin table"


def test_rotate_half(solution):
    x = torch.arange(1.0, 7.0)  # (1, 2, 3 | 4, 5, 6)
    assert solution.rotate_half(x).tolist() == [-4.0, -5.0, -6.0, 1.0, 2.0, 3.0]


def test_each_pair_turns_by_position_times_theta_i(solution):
    positions = torch.tensor([0, 1, 2, 7, 30])
    for theta in (10000.0, 500000.0):
        q, k = torch.randn(2, 4, 5, 16, dtype=torch.float64), torch.randn(2, 2, 5, 16, dtype=torch.float64)
        q_rot, k_rot = solution.apply_rope(q, k, positions, theta)
        assert q_rot.shape == q.shape and k_rot.shape == k.shape, "keep the shapes (GQA: k has fewer heads)"
        for name, got, x in (("q", q_rot, q), ("k", k_rot, k)):
            err = (got - rotate_pairs_reference(x, positions, theta)).abs().max().item()
            assert err < 1e-4, f"{name}: max error {err:.3g} against the 2x2 rotation of each (i, i + D/2) pair"


def test_position_zero_is_not_rotated_and_norms_are_kept(solution):
    q = torch.randn(1, 2, 3, 8)
    q_rot, _ = solution.apply_rope(q, q, torch.tensor([0, 3, 9]))
    assert torch.allclose(q_rot[:, :, 0], q[:, :, 0], atol=1e-6), "position 0 turns by angle 0"
    assert torch.allclose(q_rot.norm(dim=-1), q.norm(dim=-1), atol=1e-5), "a rotation keeps every vector's length"


def test_scores_depend_only_on_the_distance(solution):
    """(R_m q) . (R_n k) = q . R_{n-m} k: shifting both positions by 11 keeps the score."""
    q, k = torch.randn(1, 1, 1, 32, dtype=torch.float64), torch.randn(1, 1, 1, 32, dtype=torch.float64)
    for m, n in ((3, 8), (20, 2), (0, 0)):
        a = [solution.apply_rope(q, k, torch.tensor([p])) for p in (m, n, m + 11, n + 11)]
        near = (a[0][0] * a[1][1]).sum()
        far = (a[2][0] * a[3][1]).sum()
        assert torch.allclose(near, far, atol=1e-5), f"score at ({m}, {n}) != score at ({m + 11}, {n + 11})"


def test_keeps_the_input_dtype(solution):
    q = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16)
    q_rot, k_rot = solution.apply_rope(q, q, torch.arange(3))
    assert q_rot.dtype == k_rot.dtype == torch.bfloat16
