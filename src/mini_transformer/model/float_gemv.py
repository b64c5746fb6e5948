"""The matrix-vector product of a CPU decode step in fp32, bf16 or fp16: weights read once, summed in fp32.

At batch 1 a decode step multiplies one activation row by every weight matrix, and each weight is used
once: the step's time is the time to stream the weights in from memory. bf16/fp16 weights are half fp32's
bytes, so the same step can run at up to ~2x fp32's speed - if the weights stream at the memory's speed.

The kernel (`_SOURCE`, C++ built on first use by `_native.build`) does, for x (M, K) and W (N, K), M <= 8:

    y[m, n] = round( sum_k x[m, k] * W[n, k]  (+ bias[n]) )     the sum in fp32, rounded ONCE to x's dtype

  * W is read FRONT TO BACK, one row after the other: one sequential stream, which the core's hardware
    prefetcher follows at full speed. (An earlier version read 8 rows side by side - 8 short streams of
    1.5 KB each, which the prefetcher keeps losing: 22-27 GB/s against 32-37 GB/s sequential, measured on
    this model's 60 weight matrices + head at one thread; software prefetch helped neither.)
  * 4 independent fp32 accumulators per activation row, so an add never waits for the previous one;
    each 64-byte piece of W is loaded once into a register and used for every activation row (<= 4 at a
    time; rows 5-8 read the weight row again, from L1).
  * bf16: `vdpbf16ps` (AVX512_BF16, `_mm512_dpbf16_ps`) - 32 bf16 pairs, each product exact in fp32
    (8-bit x 8-bit significands), added pairwise into 16 fp32 lanes, no separate widening step.
    fp16: 16 halves widened with `vcvtph2ps`, then fused multiply-add. fp32: fused multiply-add.
  * K not a multiple of the vector width: the last piece is a masked load (missing lanes read as zeros);
  * rows of W split over threads with at::parallel_for; each row is summed by one thread in one order,
    so every thread count gives the same bits.

Where fp32 matters in a 16-bit model (checked in layers.py / static_cache.py / transformer.py): the GEMV
sums here (a bf16 running sum of 768 terms would keep ~3 significant digits); RMSNorm (layers.py computes
mean(x^2) and the rsqrt in fp32, then rounds); attention scores, softmax and the sum over keys (the compiled
decode step's `_one_query_attention` widens q, k, v to fp32; eager sdpa / oneDNN flash attention accumulate
in fp32); the loss (cross-entropy on fp32 logits). Stored activations and the KV cache stay 16-bit - the
places eager `F.linear` (oneDNN: fp32 accumulation, one rounding) rounds too.

`float_gemv_reference` is the same arithmetic in PyTorch (fp32 matmul of the widened values, rounded
once); the operator is `mt_float::gemv`, with a shape function so a compiled step calls it like an aten op.
"""

from __future__ import annotations

from functools import cache

import torch

from .._native import build

MAX_ROWS = 8  # a decode step's matmul with at most this many rows (batch x 1 token) takes the kernel
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cstdint>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define MT_AVX512 1
#endif
#if defined(MT_AVX512) && defined(__AVX512BF16__)
#define MT_AVX512_BF16 1
#endif

using bf16 = c10::BFloat16;
using fp16 = c10::Half;

#ifdef MT_AVX512
// One element type: how many values one register holds (L), a (masked) load, and acc += x * w over a register.
struct F32 {
  using T = float;
  using V = __m512;
  static constexpr int L = 16;
  static V load(const T* p, int n) {
    return n == L ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
  }
  static __m512 madd(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};
struct F16 {  // widened to fp32 on load (vcvtph2ps), exact
  using T = fp16;
  using V = __m512;
  static constexpr int L = 16;
  static V load(const T* p, int n) {
    const __m256i h = n == L ? _mm256_loadu_si256((const __m256i*)p)
                             : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), p);
    return _mm512_cvtph_ps(h);
  }
  static __m512 madd(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};
#ifdef MT_AVX512_BF16
struct BF16 {  // pairs of products added into 16 fp32 lanes by vdpbf16ps
  using T = bf16;
  using V = __m512bh;
  static constexpr int L = 32;
  static V load(const T* p, int n) {
    return (V)(n == L ? _mm512_loadu_si512((const void*)p) : _mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), p));
  }
  static __m512 madd(__m512 acc, V x, V w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#endif

// Weight rows [n0, n1) (w, stride K) against MR activation rows (x, stride K) -> y (MR, N), each sum + bias
// rounded once. A accumulators per activation row; each register of w is loaded once and used MR times.
template <class E, int MR>
static void rows_of(const typename E::T* x, const typename E::T* w, const typename E::T* bias, typename E::T* y,
                    int64_t N, int64_t K, int64_t n0, int64_t n1) {
  using T = typename E::T;
  constexpr int A = 4, L = E::L;
  for (int64_t n = n0; n < n1; ++n) {
    const T* row = w + n * K;
    __m512 acc[MR][A];
    for (int m = 0; m < MR; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + A * L <= K; k += A * L)  // full steps of A registers
      for (int a = 0; a < A; ++a) {
        const typename E::V wv = E::load(row + k + a * L, L);
        for (int m = 0; m < MR; ++m) acc[m][a] = E::madd(acc[m][a], E::load(x + m * K + k + a * L, L), wv);
      }
    for (; k < K; k += L) {  // the rest, one register at a time, the last one masked
      const int left = (int)std::min<int64_t>(L, K - k);
      const typename E::V wv = E::load(row + k, left);
      for (int m = 0; m < MR; ++m) acc[m][0] = E::madd(acc[m][0], E::load(x + m * K + k, left), wv);
    }
    const float b = bias ? static_cast<float>(bias[n]) : 0.f;
    for (int m = 0; m < MR; ++m) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
      y[m * N + n] = T(_mm512_reduce_add_ps(sum) + b);  // rounded once
    }
  }
}

// MR = 1..4 activation rows at a time, through E's registers.
template <class E>
struct Vectorized {
  using T = typename E::T;
  static void rows(const T* x, int64_t mr, const T* w, const T* bias, T* y, int64_t N, int64_t K, int64_t n0,
                   int64_t n1) {
    switch (mr) {
      case 1: return rows_of<E, 1>(x, w, bias, y, N, K, n0, n1);
      case 2: return rows_of<E, 2>(x, w, bias, y, N, K, n0, n1);
      case 3: return rows_of<E, 3>(x, w, bias, y, N, K, n0, n1);
      default: return rows_of<E, 4>(x, w, bias, y, N, K, n0, n1);
    }
  }
};
#endif

// The portable loop: the same sums one value at a time (used where the vector type is not built).
template <typename Scalar>
struct Portable {
  using T = Scalar;
  static void rows(const T* x, int64_t mr, const T* w, const T* bias, T* y, int64_t N, int64_t K, int64_t n0,
                   int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < mr; ++m) {
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s += static_cast<float>(x[m * K + k]) * static_cast<float>(w[n * K + k]);
        y[m * N + n] = T(s + (bias ? static_cast<float>(bias[n]) : 0.f));
      }
  }
};

// y (M, N) = x (M, K) W (N, K)^T + bias for the weight rows [begin, end): 64 rows at a time (192 KB of fp32
// weights at K = 768: they stay in L2), each block against the rows of x 4 at a time, so for M > 4 the
// block is read from memory once. noinline: inlined into parallel_for's lambda inside the dtype dispatch, the
// same loops ran 20-25% slower (measured, all three dtypes; the loops' instructions looked alike - the
// surrounding function's register pressure, most likely), called as a function of its own they run at ~40 GB/s.
template <class D>
__attribute__((noinline)) static void gemv_range(const typename D::T* x, const typename D::T* w,
                                                 const typename D::T* bias, typename D::T* y, int64_t M, int64_t N,
                                                 int64_t K, int64_t begin, int64_t end) {
  constexpr int64_t kBlock = 64;
  for (int64_t n0 = begin; n0 < end; n0 += kBlock)
    for (int64_t m = 0; m < M; m += 4)
      D::rows(x + m * K, std::min<int64_t>(4, M - m), w, bias, y + m * N, N, K, n0, std::min(n0 + kBlock, end));
}

template <class D>
static void gemv_rows(const typename D::T* x, const typename D::T* w, const typename D::T* bias, typename D::T* y,
                      int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 64, [=](int64_t begin, int64_t end) { gemv_range<D>(x, w, bias, y, M, N, K, begin, end); });
}

template <typename T>
static void gemv_typed(const T* x, const T* w, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
#ifdef MT_AVX512
  if constexpr (std::is_same_v<T, float>) return gemv_rows<Vectorized<F32>>(x, w, bias, y, M, N, K);
  if constexpr (std::is_same_v<T, fp16>) return gemv_rows<Vectorized<F16>>(x, w, bias, y, M, N, K);
#ifdef MT_AVX512_BF16
  if constexpr (std::is_same_v<T, bf16>) return gemv_rows<Vectorized<BF16>>(x, w, bias, y, M, N, K);
#endif
#endif
  gemv_rows<Portable<T>>(x, w, bias, y, M, N, K);
}

// x (M, K), weight (N, K), bias (N,) or None, one dtype (fp32, bf16, fp16) -> (M, N) of that dtype
torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "mt_float::gemv: x (M, K), weight (N, K)");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(weight.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "mt_float::gemv: x and weight of one dtype: float32, bfloat16 or float16");
  x = x.contiguous(), weight = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  torch::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->numel() == N, "mt_float::gemv: bias (N,) of x's dtype");
    b = bias->contiguous();
  }
  auto y = torch::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "mt_float::gemv", [&] {
    const scalar_t* bias_data = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    gemv_typed<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), bias_data, y.data_ptr<scalar_t>(), M, N,
                         K);
  });
  return y;
}

bool vectorized(c10::ScalarType dtype) {  // whether `dtype` runs the AVX-512 loop here (else the portable one)
#ifdef MT_AVX512
  if (dtype == at::kFloat || dtype == at::kHalf) return true;
#endif
#ifdef MT_AVX512_BF16
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

TORCH_LIBRARY(mt_float, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("vectorized(ScalarType dtype) -> bool");
}
TORCH_LIBRARY_IMPL(mt_float, CPU, m) {
  m.impl("gemv", &gemv);
}
TORCH_LIBRARY_IMPL(mt_float, CompositeExplicitAutograd, m) {
  m.impl("vectorized", &vectorized);
}
"""


def float_gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K), weight (N, K), bias (N,) or None, one dtype -> (M, N) of that dtype: the kernel's arithmetic
    (the values widened to fp32, the sum in fp32, one rounding) in PyTorch."""
    y = x.float() @ weight.float().t()  # (M, N) fp32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@cache
def kernel_available(dtype: torch.dtype) -> bool:
    """Build and load the C++ kernel (first call in a process). True only where `dtype` runs its AVX-512
    loop (bf16 needs AVX512_BF16): the portable loop is no faster than inductor's fused reduction."""
    if dtype not in DTYPES or not build("mt_float", _SOURCE, "float GEMV", fakes={"mt_float::gemv": _gemv_shape}):
        return False
    return bool(torch.ops.mt_float.vectorized(dtype))


def _gemv_shape(x, weight, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])


def takes(mat1: torch.Tensor, mat2: torch.Tensor) -> bool:
    """Whether the decode step's mm(mat1 (M, K), mat2 (K, N)) goes to the kernel: fp32/bf16/fp16, a few rows,
    on the CPU, mat2 a transposed (N, K) weight laid out row by row (as nn.Linear's), and the kernel built."""
    return (mat1.dtype == mat2.dtype and mat1.dim() == mat2.dim() == 2 and mat1.shape[0] <= MAX_ROWS
            and mat1.device.type == "cpu" and mat2.t().is_contiguous() and kernel_available(mat1.dtype))


def float_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias) -> (M, N): the kernel where it is built, else the reference."""
    if x.device.type == "cpu" and kernel_available(x.dtype):
        return torch.ops.mt_float.gemv(x, weight, bias)
    return float_gemv_reference(x, weight, bias)
