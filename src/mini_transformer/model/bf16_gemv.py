"""The 16-bit matrix-vector product of a decode step: bf16 weights x bf16 activations, summed in fp32.

At batch 1 a decode step multiplies one activation row by every weight matrix, and each weight is used
once: the step's time is the time to stream the weights in. bf16 weights are half fp32's bytes, so the
same step can run at up to ~2x fp32's speed - if every byte is used where it lands in a register.

The kernel (`_SOURCE`, C++ built on first use by `_native.build`) does, for x (M, K) and W (N, K), M <= 8:

    y[m, n] = round_bf16( sum_k x[m, k] * W[n, k]  (+ bias[n]) )     the sum in fp32, rounded ONCE

  * `vdpbf16ps` (AVX512_BF16, intrinsic `_mm512_dpbf16_ps`): 32 bf16 pairs in two registers, each
    product exact in fp32 (8-bit x 8-bit significands), added pairwise into 16 fp32 lanes - one
    instruction per 64 bytes of weights, no conversion step (bf16 -> fp32 is only a 16-bit shift, which
    the instruction does inside);
  * 8 weight rows x up to 2 activation rows at a time: 8-16 independent fp32 accumulators, so the adds
    never wait for the previous one (one accumulator would be bound by the instruction's latency), 8
    read streams in flight, and each weight row is read once per two activation rows;
  * K not a multiple of 32: the last chunk is a masked load (the missing lanes read as zeros);
  * rows of W split over threads with at::parallel_for.

Where fp32 matters (the rest of a bf16 model, checked in layers.py / static_cache.py / transformer.py):
the GEMV sums here (a bf16 running sum of 768 terms would keep ~3 significant digits); RMSNorm (layers.py
computes mean(x^2) and the rsqrt in fp32, then rounds); attention scores, softmax and the sum over keys
(the compiled decode step's `_one_query_attention` widens q, k, v to fp32; eager sdpa / oneDNN flash
attention accumulate in fp32); the loss (cross-entropy on fp32 logits). Stored activations and the KV
cache stay bf16 - the same places eager bf16 `F.linear` (oneDNN: fp32 accumulation, one rounding) rounds,
so the compiled step gives eager's numbers up to the order of the fp32 sums.

`bf16_gemv_reference` is the same arithmetic in PyTorch (fp32 matmul of the widened values, rounded
once); the operator is `mt_bf16::gemv`, with a shape function so a compiled step calls it like an aten op.
"""

from __future__ import annotations

from functools import cache

import torch

from .._native import build

MAX_ROWS = 8  # a decode step's matmul with at most this many rows (batch x 1 token) takes the kernel

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cstdint>
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define MT_AVX512_BF16 1
#endif

using bf16 = c10::BFloat16;

#ifdef MT_AVX512_BF16
static inline __m512bh load32(const bf16* p, int64_t n) {  // n <= 32 values; the rest read as 0
  if (n == 32) return (__m512bh)_mm512_loadu_si512((const void*)p);
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), (const void*)p);
}

// MR activation rows (x, stride K) x R weight rows (w, stride K) -> sums[m * R + r], fp32.
template <int MR, int R>
static void tile(const bf16* x, const bf16* w, int64_t K, float* sums) {
  __m512 acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  auto step = [&](int64_t k, int64_t n) {  // inputs [k, k + n), n <= 32
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load32(w + r * K + k, n);  // each weight byte loaded once here
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = load32(x + m * K + k, n);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);  // 32 products
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, 32);  // full chunks: plain loads (a test of n per load cost ~10%)
  if (k < K) step(k, K - k);                  // the tail: masked loads
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) sums[m * R + r] = _mm512_reduce_add_ps(acc[m][r]);
}
#endif

// The portable loop: the same sums, one value at a time (bf16 -> float is exact).
template <int MR, int R>
static void tile_portable(const bf16* x, const bf16* w, int64_t K, float* sums) {
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += (float)x[m * K + k] * (float)w[r * K + k];
      sums[m * R + r] = s;
    }
}

template <int MR, int R>
static void run_tile(const bf16* x, const bf16* w, int64_t K, float* sums) {
#ifdef MT_AVX512_BF16
  tile<MR, R>(x, w, K, sums);
#else
  tile_portable<MR, R>(x, w, K, sums);
#endif
}

// Weight rows [n, n + R) against every activation row, 2 at a time; results rounded once to bf16.
template <int R>
static void rows(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t M, int64_t N, int64_t K,
                 int64_t n) {
  float sums[2 * R];
  for (int64_t m = 0; m < M; m += 2) {
    const int mr = M - m >= 2 ? 2 : 1;
    if (mr == 2) run_tile<2, R>(x + m * K, w + n * K, K, sums);
    else run_tile<1, R>(x + m * K, w + n * K, K, sums);
    for (int i = 0; i < mr; ++i)
      for (int r = 0; r < R; ++r) {
        float s = sums[i * R + r] + (bias ? (float)bias[n + r] : 0.f);
        y[(m + i) * N + n + r] = bf16(s);  // round to nearest even, once
      }
  }
}

// x (M, K) bf16, weight (N, K) bf16, bias (N,) bf16 or None -> (M, N) bf16
torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "mt_bf16::gemv: x (M, K), weight (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "mt_bf16::gemv: bf16 inputs");
  x = x.contiguous(), weight = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const bf16* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N, "mt_bf16::gemv: bias (N,) bf16");
    bias_c = bias->contiguous();
    b = bias_c.data_ptr<bf16>();
  }
  auto y = torch::empty({M, N}, x.options());
  const bf16 *xp = x.data_ptr<bf16>(), *wp = weight.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const int64_t blocks = N / 8;  // 8 weight rows at a time (measured: 4 rows ~20% slower, 16 no faster)
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) rows<8>(xp, wp, b, yp, M, N, K, 8 * i);
  });
  for (int64_t n = 8 * blocks; n < N; ++n) rows<1>(xp, wp, b, yp, M, N, K, n);
  return y;
}

bool vectorized() {
#ifdef MT_AVX512_BF16
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY(mt_bf16, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("vectorized() -> bool");
}
TORCH_LIBRARY_IMPL(mt_bf16, CPU, m) {
  m.impl("gemv", &gemv);
}
TORCH_LIBRARY_IMPL(mt_bf16, CompositeExplicitAutograd, m) {
  m.impl("vectorized", &vectorized);
}
"""


def bf16_gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K), weight (N, K), bias (N,) or None, all bf16 -> (M, N) bf16: the kernel's arithmetic
    (every product exact in fp32, the sum in fp32, one rounding) in PyTorch."""
    y = x.float() @ weight.float().t()  # (M, N) fp32
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16)


@cache
def kernel_available() -> bool:
    """Build and load the C++ kernel (first call in a process). True only where it was built with
    AVX512_BF16: without it the portable loop is no faster than inductor's fused reduction."""
    if not build("mt_bf16", _SOURCE, "bf16 GEMV", fakes={"mt_bf16::gemv": _gemv_shape}):
        return False
    return bool(torch.ops.mt_bf16.vectorized())


def _gemv_shape(x, weight, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])


def takes(mat1: torch.Tensor, mat2: torch.Tensor) -> bool:
    """Whether the decode step's mm(mat1 (M, K), mat2 (K, N)) goes to the kernel: bf16, a few rows, on
    the CPU, mat2 a transposed (N, K) weight laid out row by row (as nn.Linear's), and the kernel built."""
    return (mat1.dtype == mat2.dtype == torch.bfloat16 and mat1.dim() == mat2.dim() == 2
            and mat1.shape[0] <= MAX_ROWS and mat1.device.type == "cpu" and mat2.t().is_contiguous()
            and kernel_available())


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias) -> (M, N) bf16: the kernel where it is built, else the reference."""
    if x.device.type == "cpu" and kernel_available():
        return torch.ops.mt_bf16.gemv(x, weight, bias)
    return bf16_gemv_reference(x, weight, bias)
