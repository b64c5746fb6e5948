"""_native.py: each C++ build named after everything its binary depends on; the narrower builds of every
kernel (the portable path; AVX2 alone, AVX-512 off) against the kernel's PyTorch reference."""

import math
import platform

import pytest
import torch
import torch.nn as nn
from support import on_threads
from test_float_gemv import assert_within_rounding, inputs, int8_inputs
from test_one_query_cpu import exact_one_query, one_query_setup
from test_paged_cpu import decode_setup
from test_quantize import assert_rows_same_alone_or_among_rows, reference_in_float64

from mini_transformer import _native
from mini_transformer.attention.paged import paged_decode_attention
from mini_transformer.model import fused_ops
from mini_transformer.model.float_gemv import DTYPES, float_gemv_reference
from mini_transformer.model.quantize import Int4Linear
from mini_transformer.model.rope import apply_rope


def test_the_build_name_follows_the_source_and_the_torch_install(monkeypatch):
    name = _native._build_name("mt_x", "int f();")
    assert name == _native._build_name("mt_x", "int f();") and name.startswith("mt_x_")
    assert _native._build_name("mt_x", "int g();") != name
    # a second virtual environment (another torch directory) builds into its own directory: the build's
    # command line names torch's include and lib paths, and ninja would rebuild on every change of them
    monkeypatch.setattr(torch, "__file__", "/elsewhere/.venv/lib/python3.11/site-packages/torch/__init__.py")
    assert _native._build_name("mt_x", "int f();") != name


def test_the_kernels_are_compiled_for_torchs_threads():
    """Without -fopenmp, ATen/ParallelOpenMP.h makes at::parallel_for a loop on the calling thread: the
    kernels would never split their work, whatever torch.set_num_threads says."""
    if torch.backends.openmp.is_available() and platform.system() != "Darwin":
        assert all("-fopenmp" in _native._cflags(variant) for variant in (None, *_native.VARIANTS))


# Every kernel built for less than this machine has, each build once into one extension whose operators end in
# _portable (the plain C++ a machine without AVX2 runs), _avx2 (the path a machine without AVX-512 runs) or
# _avx512 (AVX-512 without BF16 and VNNI, as on Skylake-SP: bf16 widened on load, int4 on the AVX2 loop),
# against the same references as the ordinary build's tests: so one machine checks the narrower paths too.

class Variant:
    """torch.ops for one build: `variant.mt_float.gemv` is torch.ops.mt_float_<name>.gemv."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, library: str):
        return getattr(torch.ops, f"{library}_{self.name}")


@pytest.fixture(scope="module", params=list(_native.VARIANTS))
def variant(request):
    if not _native.build_variant(request.param):
        pytest.skip(f"the {request.param} C++ kernels cannot be built or run here")
    ops = Variant(request.param)
    if platform.machine().lower() in ("x86_64", "amd64"):  # the build really left the wider paths out
        simd = request.param != "portable"  # every kernel with a SIMD path has an AVX2 one
        assert ops.mt_paged.vectorized() == simd and ops.mt_one_query.vectorized() == simd
        assert ops.mt_gemv.vectorized() == simd
        assert all(ops.mt_float.vectorized(d) == simd for d in (*DTYPES, torch.int8))
    return ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, N, K, bias", [(1, 1, 1, False), (1, 70, 300, True), (3, 65, 48, False),
                                           (5, 100, 17, True), (8, 33, 257, False)])
def test_variant_float_gemv_within_rounding(variant, threads, dtype, M, N, K, bias):
    """K with and without a tail past the 16 lanes, 1-8 rows (4 at a time and what is left): within one
    rounding of float64, and at most one step of the dtype plus the fp32 sums' bounds from the reference."""
    x, w, b = inputs(M, N, K, bias, M * N + K, dtype)
    got = variant.mt_float.gemv(x, w, b)
    assert_within_rounding(got, x, w, b)
    want = float_gemv_reference(x, w, b).double()
    ulp = torch.finfo(dtype).eps * 2.0 ** torch.floor(torch.log2(want.abs().clamp(min=torch.finfo(dtype).tiny)))
    size = x.double().abs() @ w.double().abs().t() + (b.double().abs() if b is not None else 0)
    step = ulp if dtype != torch.float32 else 0
    assert bool(((got.double() - want).abs() <= step + 2 * (K + 1) * 2.0 ** -24 * size).all())


@pytest.mark.parametrize("M, N, K, bias", [(1, 1, 1, False), (1, 70, 300, True), (5, 100, 17, True),
                                           (8, 33, 257, False)])
def test_variant_int8_gemv_within_rounding(variant, threads, M, N, K, bias):
    x, q, s, b = int8_inputs(M, N, K, bias, M * N + K)
    got = variant.mt_float.gemv_int8(x, q, s, b)
    exact = (x.double() @ q.double().t()) * s.double() + (b.double() if b is not None else 0)
    size = (x.double().abs() @ q.double().abs().t()) * s.double() + (b.double().abs() if b is not None else 0)
    assert bool(((got.double() - exact).abs() <= 2 * (K + 2) * 2.0 ** -24 * size).all())


@pytest.mark.parametrize("dtype", (*DTYPES, torch.int8))
def test_variant_float_gemv_row_same_bits_alone_or_in_a_batch(variant, dtype):
    """Rows go 4 at a time and then what is left, so row 4 of 8 shares its pass with other rows and row 0 of 1
    does not: a row's sum must keep one order either way."""
    K = 300  # a tail past every register width
    if dtype == torch.int8:
        x, q, s, b = int8_inputs(8, 70, K, True, 3)
        batch = variant.mt_float.gemv_int8(x, q, s, b)
        alone = torch.cat([variant.mt_float.gemv_int8(x[m:m + 1], q, s, b) for m in range(8)])
    else:
        x, w, b = inputs(8, 70, K, True, 3, dtype)
        batch = variant.mt_float.gemv(x, w, b)
        alone = torch.cat([variant.mt_float.gemv(x[m:m + 1], w, b) for m in range(8)])
    assert torch.equal(batch, alone)


@pytest.mark.parametrize("group_size, K, rows", [(32, 96, 1), (64, 256, 3), (64, 192, 2), (128, 384, 9),
                                                 (256, 512, 1)])
def test_variant_int4_gemv_equals_float64(variant, threads, group_size, K, rows):
    torch.manual_seed(group_size + K + rows)
    layer = Int4Linear.from_linear(nn.Linear(K, 70, bias=False), group_size)
    x = torch.randn(rows, K) * torch.rand(K) * 4  # groups of different ranges
    x[:, :group_size] = 0  # a group of zeros: dx = 0
    got = variant.mt_gemv.int4(x, layer.weight, layer.gemv_scale_low, group_size)
    torch.testing.assert_close(got.double(), reference_in_float64(x, layer), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_size, K", [(64, 640), (128, 384)])
def test_variant_int4_gemv_row_same_bits_alone_or_among_rows(variant, group_size, K):
    """The SIMD loops take weight rows 4 at a time and the last ones singly: each row's output is the same as
    that row's alone (a 1-row weight), whichever block it fell in; group 128 steps twice per group."""
    assert_rows_same_alone_or_among_rows(variant.mt_gemv.int4, group_size, K)


@pytest.mark.parametrize("context_lens, block_size, H, Hkv, D", [([1], 1, 4, 4, 8), ([7, 20, 3, 12], 4, 4, 2, 64),
                                                                 ([16, 32, 17, 1, 48], 16, 6, 2, 19),
                                                                 ([300, 45, 1], 16, 2, 1, 130)])
def test_variant_paged_decode_equals_reference(variant, threads, context_lens, block_size, H, Hkv, D):
    q, k_cache, v_cache, meta, seqs = decode_setup(context_lens, block_size, H, Hkv, D)
    q = q * 4  # a peaked softmax: the running max jumps, weights underflow
    args = (meta.block_tables, meta.context_lens, block_size, 1 / math.sqrt(D))
    out = variant.mt_paged.decode(q, k_cache, v_cache, *args)
    exact = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), *args)
    assert (out - paged_decode_attention(q, k_cache, v_cache, *args)).abs().max() <= 4e-6
    assert (out.double() - exact).abs().max() <= 4e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_variant_paged_decode_16_bit_within_one_rounding(variant, threads, dtype):
    q, k_cache, v_cache, meta, _ = decode_setup([40, 3, 17, 64, 1], 16, 6, 2, 64, dtype=dtype)
    args = (meta.block_tables, meta.context_lens, 16, 1 / 8)
    out = variant.mt_paged.decode(q, k_cache, v_cache, *args)
    exact = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), *args)
    assert out.dtype == dtype and ((out.double() - exact).abs() <= torch.finfo(dtype).eps * exact.abs() + 1e-6).all()


@pytest.mark.parametrize("B, H, Hkv, Tk, D, mask_kind", [(1, 4, 4, 1, 8, None), (2, 6, 2, 200, 64, "prefix-bool"),
                                                         (3, 3, 1, 130, 19, "random-add"),
                                                         (2, 4, 2, 70, 16, "random-bool")])
def test_variant_one_query_equals_float64(variant, threads, B, H, Hkv, Tk, D, mask_kind):
    q, k, v, mask, keep = one_query_setup(B, H, Hkv, Tk, D, mask_kind, B, seed=Tk)
    out, lse = variant.mt_one_query.attend(q, k, v, mask, D ** -0.5)
    want, want_lse = exact_one_query(q, k, v, keep, D ** -0.5)
    assert (out.double() - want).abs().max() <= 16 * torch.finfo(torch.float32).eps * v.abs().max()
    assert (lse.double() - want_lse).abs().max() <= 1e-5 * (1 + want_lse.abs().max())


def test_variant_fused_ops_equal_their_references(variant):
    """The fused per-token kernels (plain C++, vectorised by the compiler for the variant's instruction set)."""
    torch.manual_seed(0)
    ops = variant.mt_fused
    x, w = torch.randn(37, 389) * 3, torch.randn(389)
    qkv, cos, sin = torch.randn(2, 45, 7, 34).transpose(1, 2), torch.randn(1, 1, 45, 34), torch.randn(1, 1, 45, 34)
    tol = dict(rtol=8 * torch.finfo(torch.float32).eps, atol=1e-30)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), fused_ops.rms_norm_reference(x, w, 1e-6), **tol)
    torch.testing.assert_close(ops.rope(qkv[:, :5], cos, sin), apply_rope(qkv[:, :5], cos, sin), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ops.silu_mul(x, x.flip(0)), fused_ops.silu_mul_reference(x, x.flip(0)), **tol)
    logits = torch.randint(-4, 4, (9, 1001)).float()  # ties: the first maximum wins
    assert torch.equal(ops.argmax(logits), logits.argmax(-1))


def test_variant_kernels_same_bits_on_1_and_2_threads(variant):
    """Shapes past each kernel's grain (1001 weight rows, split in halves by csrc/row_split.h; kv heads or
    sequences to split): each output summed by one thread in one order, so 1 and 2 threads give the same bits."""
    torch.manual_seed(0)
    layer = Int4Linear.from_linear(nn.Linear(1024, 1001, bias=False), 64)
    q, k_cache, v_cache, meta, _ = decode_setup([70], 16, 6, 3, 64)
    q1, k, v, mask, _ = one_query_setup(1, 8, 4, 300, 64, "random-add", 1)
    calls = [(variant.mt_float.gemv, *inputs(3, 1001, 257, True, 0, dtype)) for dtype in DTYPES]
    calls += [(variant.mt_float.gemv_int8, *int8_inputs(3, 1001, 257, True, 0))]
    calls += [(variant.mt_gemv.int4, torch.randn(3, 1024), layer.weight, layer.gemv_scale_low, 64),
              (variant.mt_paged.decode, q, k_cache, v_cache, meta.block_tables, meta.context_lens, 16,
               0.125),
              (variant.mt_one_query.attend, q1, k, v, mask, 0.125)]
    for fn, *args in calls:
        one, two = on_threads(1, fn, *args), on_threads(2, fn, *args)
        for a, b in zip(one if isinstance(one, tuple) else [one], two if isinstance(two, tuple) else [two],
                        strict=True):
            assert torch.equal(a, b), fn
