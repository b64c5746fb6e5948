"""model/fused_ops.py: each kernel of csrc/fused_ops.cpp against its PyTorch reference and float64, and when
the modules take the kernel or the reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import on_threads

from mini_transformer.model import fused_ops
from mini_transformer.model.layers import RMSNorm, SwiGLU
from mini_transformer.model.rope import apply_rope, rotate_half

pytestmark = pytest.mark.skipif(not fused_ops.kernel_available(), reason="the fused C++ kernels cannot be built here")
ops = torch.ops.mt_fused
EPS32 = torch.finfo(torch.float32).eps


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), C=st.integers(1, 300), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_rms_norm_within_rounding_of_float64(rows, C, scale):
    torch.manual_seed(rows * 1000 + C)
    x, w = torch.randn(rows, C) * scale, torch.randn(C)
    got = ops.rms_norm(x, w, 1e-6)
    x64 = x.double()
    exact = w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert ((got.double() - exact).abs() <= 4 * EPS32 * exact.abs() + 1e-30).all()
    torch.testing.assert_close(got, fused_ops.rms_norm_reference(x, w, 1e-6), rtol=4 * EPS32, atol=0)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 3), H=st.integers(1, 5), T=st.integers(1, 40), half=st.integers(1, 40),
       per_batch=st.booleans())
def test_rope_equals_the_reference_on_a_strided_view(B, H, T, half, per_batch):
    """x as the attention has it: a transposed view of the fused qkv output (only the last dim contiguous)."""
    torch.manual_seed(B + H + T + half)
    D = 2 * half
    qkv = torch.randn(B, T, H + 2, D).transpose(1, 2)  # (B, H + 2, T, D)
    x = qkv[:, 1:H + 1]
    cos, sin = torch.randn(B if per_batch else 1, 1, T, D), torch.randn(B if per_batch else 1, 1, T, D)
    got = ops.rope(x, cos, sin)
    exact = apply_rope(x.double(), cos.double(), sin.double())
    assert got.shape == (B, H, T, D) and got.is_contiguous()
    size = x.double().abs() * cos.abs() + rotate_half(x.double()).abs() * sin.abs()
    assert ((got.double() - exact).abs() <= 2 * EPS32 * size).all()
    torch.testing.assert_close(got, apply_rope(x, cos, sin), rtol=1e-6, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 3000), scale=st.sampled_from([0.1, 4.0, 60.0]))
def test_silu_mul_within_rounding_of_float64(n, scale):
    torch.manual_seed(n)
    gate, up = torch.randn(n) * scale, torch.randn(n)
    got = ops.silu_mul(gate, up)
    exact = torch.nn.functional.silu(gate.double()) * up.double()
    assert ((got.double() - exact).abs() <= 8 * EPS32 * exact.abs() + 1e-30).all()  # e^g < 1e-37: 0


def test_silu_mul_at_the_edges_of_the_exponential():
    gate = torch.tensor([-200.0, -88.0, -87.0, -1e-8, 0.0, 1e-8, 87.0, 200.0, float("inf")])
    got, want = ops.silu_mul(gate, torch.ones_like(gate)), fused_ops.silu_mul_reference(gate, torch.ones_like(gate))
    torch.testing.assert_close(got, want, rtol=8 * EPS32, atol=1e-30)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), V=st.integers(1, 200), ties=st.integers(0, 3))
def test_argmax_is_the_first_maximum_like_torch(rows, V, ties):
    torch.manual_seed(rows * V + ties)
    x = torch.randint(-3, 3, (rows, V)).float()  # few values: many ties
    x[0] = float("-inf")  # a row with nothing allowed answers 0, as torch.argmax
    if ties and V > 1:
        x[-1, -ties:] = 1e9  # the maximum at the tail of the row, several times
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))


def test_kernels_give_the_same_bits_on_1_and_2_threads():
    """Rows past the grain, so 2 threads split them; each row is one thread's, in one order."""
    torch.manual_seed(0)
    x, w, qkv = torch.randn(300, 384), torch.randn(384), torch.randn(2, 300, 8, 64).transpose(1, 2)
    cos, sin = torch.randn(1, 1, 300, 64), torch.randn(1, 1, 300, 64)
    calls = [(ops.rms_norm, x, w, 1e-6), (ops.rope, qkv, cos, sin), (ops.silu_mul, x, x.flip(0)),
             (ops.argmax, torch.randn(64, 8192))]
    for fn, *args in calls:
        assert torch.equal(on_threads(1, fn, *args), on_threads(2, fn, *args)), fn


def test_modules_take_the_kernel_at_inference_and_the_reference_under_autograd(monkeypatch):
    """Training (gradients), a non-contiguous input and another dtype run the reference; inference runs the
    kernel and matches it to rounding."""
    called = []
    real_takes = fused_ops._takes
    monkeypatch.setattr(fused_ops, "_takes", lambda *t: called.append(real_takes(*t)) or called[-1])
    torch.manual_seed(0)
    norm = RMSNorm(64)
    x = torch.randn(3, 5, 64, requires_grad=True)
    y = norm(x)
    y.sum().backward()  # the reference ran: autograd has a graph through it
    assert x.grad is not None and called[-1] is False
    with torch.no_grad():
        fast = norm(x)
    assert called[-1] is True
    torch.testing.assert_close(fast, y.detach(), rtol=4 * EPS32, atol=0)
    with torch.no_grad():
        assert torch.equal(norm(x.double()), fused_ops.rms_norm_reference(x.double(), norm.weight, norm.eps))


def test_swiglu_and_argmax_rows_match_their_references():
    from mini_transformer.config import TransformerConfig

    torch.manual_seed(1)
    ffn = SwiGLU(TransformerConfig.from_preset("llama-tiny"))
    x = torch.randn(2, 7, ffn.w_gate.in_features)
    with torch.no_grad():
        want = ffn.w_down(fused_ops.silu_mul_reference(ffn.w_gate(x), ffn.w_up(x)))
        torch.testing.assert_close(ffn(x), want, rtol=1e-5, atol=1e-6)
    logits = torch.randn(5, 1000)
    assert torch.equal(fused_ops.argmax_rows(logits), logits.argmax(-1))
    assert torch.equal(fused_ops.argmax_rows(logits.t().contiguous().t()), logits.argmax(-1))  # reference path
