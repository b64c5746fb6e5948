"""Stage 1 attention: naive vs PyTorch SDPA vs a float64 loop written out by hand."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_transformer.attention import attention, build_mask, causal_mask


def loop_attention(q, k, v, causal=True, keep=None):
    """Row by row: scores, the visible keys, exp / sum, weighted sum of values. float64 throughout."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    out = torch.zeros(B, H, Tq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kv = h // (H // Hkv)
            for i in range(Tq):
                position = Tk - Tq + i  # queries sit at the end of the keys
                visible = [
                    j for j in range(Tk)
                    if (not causal or j <= position) and (keep is None or bool(keep[b, j]))
                ]
                if not visible:
                    continue  # no key to look at: the output stays zero
                scores = [float(q[b, h, i] @ k[b, kv, j]) / math.sqrt(D) for j in visible]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for w, j in zip(weights, visible, strict=True):
                    out[b, h, i] += (w / total) * v[b, kv, j]
    return out


def random_qkv(B, H, Hkv, Tq, Tk, D, dtype=torch.float64):
    return (torch.randn(B, H, Tq, D, dtype=dtype), torch.randn(B, Hkv, Tk, D, dtype=dtype),
            torch.randn(B, Hkv, Tk, D, dtype=dtype))


def left_padding(B, Tk, pads):
    keep = torch.ones(B, Tk, dtype=torch.bool)
    for b, p in enumerate(pads):
        keep[b, :p] = False
    return keep


def test_causal_mask_is_lower_triangular_and_end_aligned():
    assert torch.equal(causal_mask(4, 4), torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    # two queries at the end of five keys: positions 3 and 4
    expected = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(2, 5), expected)


def test_build_mask_combines_with_and():
    keep = torch.tensor([[False, True, True]])
    mask = build_mask(3, 3, causal=True, key_padding_mask=keep)
    assert mask.shape == (1, 1, 3, 3)
    assert torch.equal(mask[0, 0], causal_mask(3, 3) & keep)
    assert build_mask(3, 3, causal=False, key_padding_mask=None) is None


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("padded", [False, True])
def test_matches_hand_loop_in_float64(backend, padded):
    q, k, v = random_qkv(2, 4, 4, 6, 6, 8)
    keep = left_padding(2, 6, [0, 2]) if padded else None
    out = attention(q, k, v, causal=True, key_padding_mask=keep, backend=backend)
    expected = loop_attention(q, k, v, causal=True, keep=keep)
    rows = slice(None) if not padded else slice(2, None)  # padded query rows are never read
    assert (out[..., rows, :] - expected[..., rows, :]).abs().max() <= 1e-10


@pytest.mark.parametrize("padded", [False, True])
def test_naive_vs_sdpa_float32(padded):
    q, k, v = random_qkv(3, 4, 4, 16, 16, 16, dtype=torch.float32)
    keep = left_padding(3, 16, [0, 5, 15]) if padded else None
    a = attention(q, k, v, key_padding_mask=keep, backend="naive")
    b = attention(q, k, v, key_padding_mask=keep, backend="sdpa")
    assert (a - b).abs().max() <= 1e-5


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 3), Hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3]),
    Tq=st.integers(1, 7), extra=st.integers(0, 4), D=st.sampled_from([2, 4, 8]),
    causal=st.booleans(), data=st.data(),
)
def test_random_shapes_and_masks(B, Hkv, group, Tq, extra, D, causal, data):
    Tk = Tq + extra
    H = Hkv * group
    q, k, v = random_qkv(B, H, Hkv, Tq, Tk, D)
    bits = data.draw(st.lists(st.booleans(), min_size=B * Tk, max_size=B * Tk))
    keep = torch.tensor(bits, dtype=torch.bool).view(B, Tk)
    expected = loop_attention(q, k, v, causal=causal, keep=keep)
    for backend in ("naive", "sdpa"):
        out = attention(q, k, v, causal=causal, key_padding_mask=keep, backend=backend)
        assert not out.isnan().any()
        assert (out - expected).abs().max() <= 1e-10, backend


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_fully_masked_rows_give_zeros_and_finite_gradients(backend):
    q, k, v = (t.requires_grad_() for t in random_qkv(2, 2, 2, 4, 4, 4, dtype=torch.float32))
    keep = torch.tensor([[False] * 4, [False, False, True, True]])
    out = attention(q, k, v, key_padding_mask=keep, backend=backend)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[1, :, :2], torch.zeros_like(out[1, :, :2]))  # queries before the first real key
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[0], torch.zeros_like(q.grad[0]))


def test_gqa_equals_repeated_heads():
    q, k, v = random_qkv(2, 6, 2, 5, 5, 4)
    expected = attention(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), backend="naive")
    for backend in ("naive", "sdpa"):
        assert (attention(q, k, v, backend=backend) - expected).abs().max() <= 1e-12


def test_query_shorter_than_keys_equals_last_rows_of_full():
    q, k, v = random_qkv(1, 2, 2, 7, 7, 4)
    full = attention(q, k, v, backend="naive")
    for backend in ("naive", "sdpa"):
        tail = attention(q[:, :, -3:], k, v, backend=backend)
        assert (tail - full[:, :, -3:]).abs().max() <= 1e-12


def test_masked_scores_use_finfo_min_not_zero():
    # With 0 instead of finfo.min, a masked future key would still get weight exp(0).
    q, k, v = random_qkv(1, 1, 1, 2, 2, 2)
    v[0, 0, 1] = 1e6  # a huge value at the future position would leak into query 0
    out = attention(q, k, v, backend="naive")
    assert (out[0, 0, 0] - v[0, 0, 0]).abs().max() <= 1e-12  # query 0 sees only key 0


def test_dropout_only_when_asked():
    q, k, v = random_qkv(1, 2, 2, 8, 8, 4, dtype=torch.float32)
    base = attention(q, k, v, backend="naive")
    torch.manual_seed(1)
    dropped = attention(q, k, v, backend="naive", dropout_p=0.5)
    assert not torch.allclose(base, dropped)


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda q, k, v: attention(q[0], k, v), ValueError, "q must have 4 dims"),
        (lambda q, k, v: attention(q, k[:, :, :2], v), ValueError, "same shape"),
        (lambda q, k, v: attention(q, k[:, :, :2], v[:, :, :2]), ValueError, "Tq <= Tk"),
        (lambda q, k, v: attention(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1)), ValueError,
         "multiple of Hkv"),
        (lambda q, k, v: attention(q, k, v, backend="magic"), ValueError, "backend='magic'"),
        (lambda q, k, v: attention(q, k, v, key_padding_mask=torch.ones(2, 4)), TypeError, "bool"),
        (lambda q, k, v: attention(q, k, v, key_padding_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError,
         "(B, Tk)"),
        (lambda q, k, v: attention(q, k, v, dropout_p=1.0), ValueError, "dropout_p=1.0"),
        (lambda q, k, v: attention(q.long(), k, v), TypeError, "floating-point"),
        (lambda q, k, v: attention(q.float(), k, v), TypeError, "share a dtype"),
    ],
)
def test_bad_inputs_raise_clear_errors(make, error, words):
    q, k, v = random_qkv(2, 4, 2, 4, 4, 8)
    with pytest.raises(error, match=re.escape(words)):
        make(q, k, v)
