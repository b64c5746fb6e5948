"""model/float_gemv.py: the C++ GEMV (fp32, bf16, fp16) and its PyTorch reference, each against float64 of
the same values (fp32 sums, one rounding to the dtype); the kernel thread-count independent and in place of
the compiled decode step's matmuls, whose bf16 greedy tokens equal eager bf16 generate()'s (fp32: see
test_static_decode.py)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import on_threads

from mini_transformer import TransformerConfig, TransformerLM, generate
from mini_transformer.attention.one_query_cpu import kernel_available as one_query_kernel_available
from mini_transformer.model.float_gemv import DTYPES, MAX_ROWS, float_gemv, float_gemv_reference, kernel_available

BUILT = [dtype for dtype in DTYPES if kernel_available(dtype)]
needs_kernel = pytest.mark.skipif(not BUILT, reason="no SIMD build (AVX-512 or AVX2) of the kernel here")
HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # the one final rounding
TINY = {torch.float32: 0.0, torch.bfloat16: 0.0, torch.float16: 2.0 ** -25}  # half fp16's smallest subnormal


def inputs(M: int, N: int, K: int, bias: bool, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)
    return x, w, torch.randn(N, generator=g).to(dtype) if bias else None


def assert_within_rounding(got: torch.Tensor, x, w, b) -> None:
    """|got - exact| <= half an ulp of the dtype |exact| + 2 gamma S: `exact` the float64 product of the
    values, S = sum |x w| (+ |b|), gamma = (K + 1) 2^-24 bounds an fp32 sum of K products and the bias
    (16-bit products are exact in fp32; an fp32 fused multiply-add rounds once per term)."""
    exact = x.double() @ w.double().t()  # (M, N)
    size = x.double().abs() @ w.double().abs().t()
    if b is not None:
        exact, size = exact + b.double(), size + b.double().abs()
    gamma = (x.shape[1] + 1) * 2.0 ** -24
    assert got.dtype == x.dtype and got.shape == exact.shape
    bound = HALF_ULP[x.dtype] * exact.abs() + 2 * gamma * size + TINY[x.dtype]
    assert bool(((got.double() - exact).abs() <= bound).all())


@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, MAX_ROWS), N=st.integers(1, 40), K=st.integers(1, 200), bias=st.booleans(),
       seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES))
def test_reference_within_rounding_of_float64(M, N, K, bias, seed, dtype):
    x, w, b = inputs(M, N, K, bias, seed, dtype)
    assert_within_rounding(float_gemv_reference(x, w, b), x, w, b)


@needs_kernel
# `threads` (the torch thread count) holds for every example
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(M=st.integers(1, MAX_ROWS), N=st.integers(1, 100), K=st.integers(1, 300), bias=st.booleans(),
       seed=st.integers(0, 2**16), dtype=st.sampled_from(BUILT or [torch.float32]))
def test_kernel_within_rounding_of_float64(threads, M, N, K, bias, seed, dtype):
    """Any N (blocks of 64 rows and a partial one), K of any size (full steps of 4 registers, single
    registers and a masked tail), 1-8 rows (groups of 4 and what is left); 16-bit results at most one
    step of the dtype from the reference (both sum in fp32, in other orders, so a sum next to a rounding
    boundary may round the other way) plus the two fp32 sums' own error bounds."""
    x, w, b = inputs(M, N, K, bias, seed, dtype)
    got = torch.ops.mt_float.gemv(x, w, b)
    assert_within_rounding(got, x, w, b)
    if dtype != torch.float32:
        want = float_gemv_reference(x, w, b).double()
        exponent = torch.floor(torch.log2(want.abs().clamp(min=torch.finfo(dtype).tiny)))
        ulp = torch.finfo(dtype).eps * 2.0 ** exponent  # the dtype's spacing at |want|
        # two fp32 sums, each within gamma S of the exact one (which matters only when they cancel to a
        # result far below S), then one rounding each
        size = x.double().abs() @ w.double().abs().t() + (b.double().abs() if b is not None else 0)
        fp32_sums = 2 * (K + 1) * 2.0 ** -24 * size
        assert bool(((got.double() - want).abs() <= ulp + fp32_sums).all())


@needs_kernel
@pytest.mark.parametrize("dtype", BUILT)
def test_kernel_same_bits_on_any_thread_count_and_layout(dtype):
    """Rows of W are split over threads, one slice each (1001 rows: an odd count, so the halves differ), each
    row summed by one thread: 1 and 2 threads give the same bits;
    a transposed (non-contiguous) x gives what its contiguous copy gives."""
    x, w, b = inputs(6, 1001, 300, True, 0, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.mt_float.gemv(x, w, b)
        torch.set_num_threads(2)
        two = torch.ops.mt_float.gemv(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(torch.ops.mt_float.gemv(x.t().contiguous().t(), w, b), one)
    assert torch.equal(float_gemv(x, w, b), one)
    # and a row gives the bits it gives alone, whichever of the 4-row passes it falls in
    assert torch.equal(torch.cat([torch.ops.mt_float.gemv(x[m:m + 1], w, b) for m in range(6)]), one)


@needs_kernel
def test_kernel_refuses_other_dtypes_and_shapes():
    x, w, _ = inputs(1, 4, 8, False, 0, torch.float32)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.mt_float.gemv(x.bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.mt_float.gemv(x.double(), w.double(), None)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.mt_float.gemv(x, w[:, :4], None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.mt_float.gemv(x, w, torch.zeros(3))


def int8_inputs(M: int, N: int, K: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, q = torch.randn(M, K, generator=g), torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    return x, q, torch.rand(N, generator=g) / 127, torch.randn(N, generator=g) if bias else None


needs_int8_kernel = pytest.mark.skipif(not kernel_available(torch.int8), reason="no SIMD build of the int8 GEMV here")


@needs_int8_kernel
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(M=st.integers(1, MAX_ROWS), N=st.integers(1, 100), K=st.integers(1, 300), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_int8_kernel_within_rounding_of_float64(threads, M, N, K, bias, seed):
    """int8 weights through the same loop: fp32 x, each weight widened exactly, an fp32 sum, times the row's
    scale, plus the bias; within the fp32 sum's bound (gamma S, S = sum |x q| s + |b|, gamma = (K + 2) 2^-24
    for the K terms, the scale and the bias) of float64, for the same K, N and row counts as the float loop."""
    x, q, s, b = int8_inputs(M, N, K, bias, seed)
    got = torch.ops.mt_float.gemv_int8(x, q, s, b)
    exact = (x.double() @ q.double().t()) * s.double()
    size = (x.double().abs() @ q.double().abs().t()) * s.double()
    if b is not None:
        exact, size = exact + b.double(), size + b.double().abs()
    assert got.dtype == torch.float32 and got.shape == (M, N)
    assert bool(((got.double() - exact).abs() <= 2 * (K + 2) * 2.0 ** -24 * size).all())


@needs_int8_kernel
def test_int8_kernel_same_bits_on_any_thread_count_and_checks_its_inputs():
    x, q, s, b = int8_inputs(5, 1001, 300, True, 0)
    assert torch.equal(on_threads(1, torch.ops.mt_float.gemv_int8, x, q, s, b),
                       on_threads(2, torch.ops.mt_float.gemv_int8, x, q, s, b))
    with pytest.raises(RuntimeError, match="int8 weight"):
        torch.ops.mt_float.gemv_int8(x, q.float(), s, b)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.mt_float.gemv_int8(x, q, s[:3], b)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.mt_float.gemv_int8(x, q, s, b.double())


def bf16_llama(bias: bool) -> TransformerLM:
    torch.manual_seed(0)  # d_model 48: K = 48 and 96 are not multiples of 32; init 0.3: logits well apart
    cfg = TransformerConfig(vocab_size=50, d_model=48, n_heads=4, n_kv_heads=2, n_layer=2, d_ff=96, max_seq_len=64,
                            pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=bias, tie_weights=False,
                            attn_backend="sdpa", init_std=0.3)
    return TransformerLM(cfg).eval().to(torch.bfloat16)


# bf16 logits here (|logit| <= ~7) carry the rounding of every stored activation: eager bf16 itself is off the
# float64 model by up to ~10% of the largest logit (measured, 4 seeds), and the compiled step - whose
# attention sums in fp32 where eager sdpa rounds differently - off eager by up to ~5%, with or without the
# kernel (the same numbers to 4 digits: attention, not the GEMV, sets them). So exact token equality fails on
# near ties (top-2 logits 1-2 bf16 steps apart, in 2-6% of steps); the tests compare logits within TOLERANCE
# of the largest, and free-running tokens up to the first step whose eager top two are within 2 TOLERANCE.
TOLERANCE = 0.1


@pytest.mark.skipif(torch.bfloat16 not in BUILT, reason="no SIMD bf16 build (AVX512_BF16 or AVX2) of the kernel here")
@pytest.mark.parametrize("batch, bias", [(1, False), (3, True)])
def test_compiled_bf16_decode_runs_the_kernel_close_to_eager(batch, bias):
    """generate(compile=True) on a bf16 model: every matmul of the step is the kernel (no aten mm/addmm
    left in inductor's code; addmm carries the bias); fed eager bf16 generate()'s tokens, each step's logits
    are within TOLERANCE of eager's, and free-running greedy tokens equal eager's up to a near tie."""
    from torch._inductor.utils import run_and_get_code

    from mini_transformer import KVCache
    from mini_transformer.inference.static_cache import StaticCache, compiled_decode_step

    model, n = bf16_llama(bias), 40
    idx = torch.randint(0, 50, (batch, 5), generator=torch.Generator().manual_seed(1))
    got, code = run_and_get_code(generate, model, idx, n, compile=True)
    assert code, "the bf16 step was not compiled here"
    assert any("mt_float.gemv" in c for c in code)
    if one_query_kernel_available():  # bf16 attention: the C++ one-query kernel, once per layer
        assert sum(c.count("torch.ops.mt_one_query.attend.default(") for c in code) == model.config.n_layer
    assert not any(call in c for c in code for call in ("extern_kernels.addmm(", "extern_kernels.mm("))
    want = generate(model, idx, n)
    compiled = StaticCache.for_model(model.config, batch, 64, dtype=torch.bfloat16)
    eager = KVCache.for_model(model.config, batch, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        model.logits(idx, cache=compiled)
        model.logits(idx, cache=eager)
        step = compiled_decode_step("cpu")
        for token in want.T:  # (batch,) the eager tokens, fed to both
            logits = step(model, token, compiled).float()  # (batch, V)
            reference = model.logits(token[:, None], cache=eager)[:, -1].float()
            assert (logits - reference).abs().max() <= TOLERANCE * reference.abs().max()
        for row in range(batch):
            d = next((i for i in range(n) if got[row, i] != want[row, i]), n)
            if d < n:  # a near tie in eager's own logits at the first differing step
                context = torch.cat([idx[row], want[row, :d]])[None]
                logits = model(context)[0][0, -1].float()
                assert logits[want[row, d]] - logits[got[row, d]] <= 2 * TOLERANCE * logits.abs().max()
