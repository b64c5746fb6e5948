"""The C++ one-query kernel (attention/one_query_cpu.py, the static cache's compiled decode attention)
against float64 attention: prefix masks (what the static cache passes) and arbitrary ones, bool and
additive, shared by the batch or per row; GQA; head sizes with and without a tail past the 16-float loop;
bf16/fp16 within one rounding; logsumexp; NaN in every masked slot never read."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import on_threads

from mini_transformer.attention.one_query_cpu import kernel_available, one_query_kernel

pytestmark = pytest.mark.skipif(not kernel_available(), reason="the C++ kernel cannot be built here")


def one_query_setup(B, H, Hkv, Tk, D, mask_kind, mask_batch, dtype=torch.float32, seed=0):
    """q (B, H, 1, D), k, v (B, Hkv, Tk, D) and a mask (mask_batch, 1, 1, Tk): a prefix of each row
    ("prefix": what the static cache passes) or any keys ("random"), bool or additive; every row keeps a key."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, H, 1, D), (B, Hkv, Tk, D), (B, Hkv, Tk, D))
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for shape in shapes)
    if mask_kind is None:
        return q, k, v, None, None
    if mask_kind.startswith("prefix"):
        lens = torch.randint(1, Tk + 1, (mask_batch, 1, 1, 1), generator=gen)
        keep = torch.arange(Tk) < lens  # (mask_batch, 1, 1, Tk)
    else:
        keep = torch.rand(mask_batch, 1, 1, Tk, generator=gen) < 0.5
        keep[..., torch.randint(0, Tk, (1,), generator=gen)] = True
    additive = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))
    return q, k, v, keep if mask_kind.endswith("bool") else additive, keep


def exact_one_query(q, k, v, keep, scale):
    """float64 SDPA (GQA) and float64 logsumexp of the scores: the reference."""
    G = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(G, dim=1), v.double().repeat_interleave(G, dim=1)
    scores = qd @ kd.transpose(-1, -2) * scale  # (B, H, 1, Tk)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ vd, torch.logsumexp(scores, dim=-1)


# `threads` (the torch thread count) holds for every example
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 3), groups=st.sampled_from([1, 2, 3]), Hkv=st.integers(1, 4), Tk=st.integers(1, 200),
       D=st.sampled_from([8, 16, 19, 64]), mask_kind=st.sampled_from([None, "prefix-bool", "prefix-add",
                                                                      "random-bool", "random-add"]),
       shared_mask=st.booleans(), scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 99))
def test_one_query_kernel_equals_float64(threads, B, groups, Hkv, Tk, D, mask_kind, shared_mask, scale, seed):
    q, k, v, mask, keep = one_query_setup(B, Hkv * groups, Hkv, Tk, D, mask_kind, 1 if shared_mask else B, seed=seed)
    scale = D ** -0.5 if scale is None else scale
    out, lse = one_query_kernel(q, k, v, mask, scale)
    want, want_lse = exact_one_query(q, k, v, keep, scale)
    assert out.dtype == torch.float32 and out.shape == q.shape and lse.shape == (B, Hkv * groups, 1)
    # fp32 arithmetic: an output is a weighted mean of up to 200 V rows, each weight from a 7th-degree exp;
    # its error stays within a few fp32 roundings of the largest |v| (seen: 1.0e-6 with |v| up to 3.5)
    assert (out.double() - want).abs().max() <= 16 * torch.finfo(torch.float32).eps * v.abs().max()
    assert (lse.double() - want_lse).abs().max() <= 1e-5 * (1 + want_lse.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", ["prefix-bool", "random-add"])
def test_one_query_kernel_16_bit_within_one_rounding(threads, dtype, mask_kind):
    """bf16/fp16 K, V, q widened to fp32 as they load: the output is float64's of the same inputs,
    rounded once to the dtype (plus fp32 slack); logsumexp stays fp32."""
    q, k, v, mask, keep = one_query_setup(2, 12, 4, 384, 64, mask_kind, 2, dtype=dtype)
    out, lse = one_query_kernel(q, k, v, mask, 1 / 8)
    want, want_lse = exact_one_query(q, k, v, keep, 1 / 8)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert ((out.double() - want).abs() <= torch.finfo(dtype).eps * want.abs() + 1e-6).all()
    assert (lse.double() - want_lse).abs().max() <= 1e-5


def test_one_query_kernel_never_reads_masked_keys(threads):
    """NaN in every masked key and value slot (the static slab's unwritten slots) changes no bit."""
    q, k, v, mask, keep = one_query_setup(2, 6, 2, 100, 32, "random-bool", 2)
    before = one_query_kernel(q, k, v, mask, 0.2)
    hidden = ~keep.reshape(2, 1, 100, 1).expand_as(k)
    k[hidden], v[hidden] = float("nan"), float("nan")
    after = one_query_kernel(q, k, v, mask, 0.2)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3])
def test_one_query_kernel_same_bits_on_1_and_2_threads(dtype, B):
    """One task per (batch row, kv head), split over threads: each walked alone in one order, so 1 and 2
    threads give the same bits (B = 1: the kv heads alone fill the threads)."""
    q, k, v, mask, _ = one_query_setup(B, 8, 4, 300, 64, "random-add", B, dtype=dtype)
    one = on_threads(1, one_query_kernel, q, k, v, mask, 1 / 8)
    two = on_threads(2, one_query_kernel, q, k, v, mask, 1 / 8)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.parametrize("mask_kind", ["prefix", "random"])
@pytest.mark.parametrize("shared", [True, False])
def test_one_query_kernel_bool_mask_same_bits_as_additive(mask_kind, shared):
    """A bool mask is read in place (True = may attend) and gives the bits of its additive form (0 / -inf)."""
    q, k, v, keep_mask, _ = one_query_setup(3, 8, 4, 150, 64, f"{mask_kind}-bool", 1 if shared else 3)
    additive = torch.zeros(keep_mask.shape).masked_fill(~keep_mask, float("-inf"))
    by_bool, by_add = one_query_kernel(q, k, v, keep_mask, 0.125), one_query_kernel(q, k, v, additive, 0.125)
    assert torch.equal(by_bool[0], by_add[0]) and torch.equal(by_bool[1], by_add[1])
