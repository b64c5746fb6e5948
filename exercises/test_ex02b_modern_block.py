"""Grader for ex02b_modern_block: RMSNorm, SwiGLU, Llama's FFN width and GQA, each against its formula in float64."""

from __future__ import annotations

import math

import torch

EXERCISE = "ex02b_modern_block"


def test_rms_norm_is_the_formula(solution):
    x, w = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    got = solution.rms_norm(x, w, 1e-5)
    assert got.shape == x.shape and torch.allclose(got, expected, atol=1e-10), "x / sqrt(mean(x^2) + eps) * weight"
    shifted = solution.rms_norm(x + 3.0, w, 1e-5)
    assert not torch.allclose(shifted, got), "RMSNorm does not subtract the mean (that is LayerNorm)"


def test_rms_norm_keeps_the_dtype(solution):
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert solution.rms_norm(x, torch.ones(8), 1e-6).dtype == torch.bfloat16


def test_swiglu_is_the_formula(solution):
    C, F = 8, 12
    x = torch.randn(2, 3, C, dtype=torch.float64)
    w_gate, w_up, w_down = (torch.randn(F, C, dtype=torch.float64), torch.randn(F, C, dtype=torch.float64),
                            torch.randn(C, F, dtype=torch.float64))
    a = x @ w_gate.T
    expected = ((a * torch.sigmoid(a)) * (x @ w_up.T)) @ w_down.T
    got = solution.swiglu(x, w_gate, w_up, w_down)
    assert got.shape == x.shape and torch.allclose(got, expected, atol=1e-10), \
        "w_down(silu(w_gate x) * w_up x): is the gate on the right branch?"


def test_llama_ffn_size(solution):
    for d_model, multiple_of, expected in ((4096, 256, 11008), (64, 32, 192), (384, 64, 1024), (100, 7, 266)):
        got = solution.llama_ffn_size(d_model, multiple_of)
        assert got == expected, f"d_model={d_model}, multiple_of={multiple_of}: {got}, expected {expected}"


def test_gqa_uses_kv_head_h_div_g(solution):
    B, H, Hkv, T, D = 2, 6, 2, 5, 8
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    k, v = torch.randn(B, Hkv, T, D, dtype=torch.float64), torch.randn(B, Hkv, T, D, dtype=torch.float64)
    G = H // Hkv
    expected = torch.stack([torch.softmax(q[:, h] @ k[:, h // G].transpose(-2, -1) / math.sqrt(D), -1) @ v[:, h // G]
                            for h in range(H)], dim=1)
    got = solution.gqa_attention(q, k, v)
    assert got.shape == (B, H, T, D), f"output shape {tuple(got.shape)}, expected {(B, H, T, D)}"
    assert torch.allclose(got, expected, atol=1e-10), "query head h must use kv head h // G (not h % Hkv)"
    assert torch.allclose(solution.gqa_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)), expected,
                          atol=1e-10), "with Hkv == H it is plain multi-head attention"
