"""The 4-bit matrix-vector product of a decode step: int4 weights x int8 activations, integer dot products.

A decode step multiplies a few activation rows x (M, K) by every weight matrix. With 4-bit weights the
time is set by how fast the packed bytes stream in, so the product must use each byte where it lands in
a register: unpacking the nibbles to float, or worse writing a dequantized float matrix to memory and
reading it back (8x the bytes of the packed one), loses what 4 bits saved. ggml's Q4_0 x Q8_0 idea:

  1. quantize each activation row once, per group of `group_size` inputs (the weight's groups):
         dx[g] = max |x[g]| / 127,   xq = round(x / dx)  in [-127, 127]          (K values, int8)
  2. per weight row n and group g, an integer dot product of the 4-bit codes with xq:
         dot[n, g] = sum_k q[n, k] * xq[k]         (q in [0, 15]; exact in int32)
  3. y[n] = sum_g  scale[n, g] * dx[g] * dot[n, g]  +  low[n, g] * sum_{k in g} x[k]
     because w = q * scale + low (Int4Linear's asymmetric groups: low = the group's minimum).

Two implementations of exactly this arithmetic (tests check them against each other and float64):
  * `int4_gemv_reference`: plain PyTorch, readable; used where the C++ kernel cannot be built;
  * the C++ kernel (`_SOURCE`, built on first use with torch.utils.cpp_extension.load_inline): per
    64 inputs, 32 bytes are loaded once, split into low/high nibbles and multiplied with the int8
    activations by ONE `vpdpbusd` (AVX512-VNNI: 64 u8 x s8 products summed into 16 int32 lanes).
    The packed layout is the one Int4Linear saves: byte j of a row holds inputs 2j (low nibble) and
    2j+1 (high), so the activations are reordered instead, evens then odds within each 64 (or 32).
It is registered as the operator `mt_gemv::int4`, so a compiled decode step calls it like any aten op.

int8 weights do NOT go this way: measured over 36 768 x 2048 matrices (56.6 MB, 1 thread) the same
VNNI loop for int8 x int8 ran at the speed of inductor's fused int8 -> float reduction (~19 GB/s both, the
memory bound here), and it would add activation rounding; int8 keeps the compiled reduction (quantize.py).
"""

from __future__ import annotations

from functools import cache

import torch

from .._native import build

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <utility>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define MT_VNNI 1
#endif

// One activation row, quantized per group: codes reordered per chunk of `chunk` inputs (evens, then odds),
// dx (G,) the group scales, xsum (G,) the float sum of each group.
static void quantize_row(const float* x, int64_t K, int64_t group, int64_t chunk,
                         int8_t* xq, float* dx, float* xsum) {
  for (int64_t g = 0; g < K / group; ++g) {
    const float* xg = x + g * group;
    float amax = 0.f, s = 0.f;
    for (int64_t k = 0; k < group; ++k) { amax = std::max(amax, std::fabs(xg[k])); s += xg[k]; }
    float d = amax / 127.f;
    dx[g] = d;
    xsum[g] = s;
    for (int64_t c = 0; c < group; c += chunk) {
      int8_t* out = xq + g * group + c;
      for (int64_t j = 0; j < chunk / 2; ++j) {
        float even = xg[c + 2 * j], odd = xg[c + 2 * j + 1];
        out[j] = d == 0.f ? 0 : (int8_t)std::nearbyint(even / d);
        out[chunk / 2 + j] = d == 0.f ? 0 : (int8_t)std::nearbyint(odd / d);
      }
    }
  }
}

// sum over one group of q[k] * xq[k]: `bytes` packed bytes against the reordered codes.
static inline int32_t group_dot(const uint8_t* w, const int8_t* xq, int64_t bytes, int64_t chunk) {
  int32_t total = 0;
  for (int64_t c = 0; c < bytes; c += chunk / 2) {
    for (int64_t j = 0; j < chunk / 2; ++j) {
      total += (int32_t)(w[c + j] & 15) * xq[2 * c + j] + (int32_t)(w[c + j] >> 4) * xq[2 * c + chunk / 2 + j];
    }
  }
  return total;
}

static float row_dot(const uint8_t* w, const float* scale, const float* low, const int8_t* xq,
                     const float* dx, const float* xsum, int64_t G, int64_t group, int64_t chunk) {
  float y = 0.f;
#ifdef MT_VNNI
  if (chunk == 64) {
    const __m256i mask = _mm256_set1_epi8(15);
    auto group_sum = [&](int64_t g) {  // (16,) float partial sums of scale * dx * q . xq over group g
      __m512i dot = _mm512_setzero_si512();
      for (int64_t c = 0; c < group / 2; c += 32) {
        __m256i b = _mm256_loadu_si256((const __m256i*)(w + g * group / 2 + c));  // 64 inputs, 4 bits each
        __m256i lo = _mm256_and_si256(b, mask), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
        __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // evens, then odds
        dot = _mm512_dpbusd_epi32(dot, q, _mm512_loadu_si512((const void*)(xq + g * group + 2 * c)));
      }
      return std::make_pair(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(scale[g] * dx[g]));
    };
    // two accumulators, even and odd groups: through one, each group waited for the previous fma
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 1 < G; g += 2) {
      auto [d0, s0] = group_sum(g);
      auto [d1, s1] = group_sum(g + 1);
      acc0 = _mm512_fmadd_ps(d0, s0, acc0);
      acc1 = _mm512_fmadd_ps(d1, s1, acc1);
    }
    if (g < G) {
      auto [d0, s0] = group_sum(g);
      acc0 = _mm512_fmadd_ps(d0, s0, acc0);
    }
    for (int64_t k = 0; k < G; ++k) y += low[k] * xsum[k];
    return y + _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
#endif
  for (int64_t g = 0; g < G; ++g) {
    int32_t dot = group_dot(w + g * group / 2, xq + g * group, group / 2, chunk);
    y += scale[g] * dx[g] * (float)dot + low[g] * xsum[g];
  }
  return y;
}

// x (M, K) float32, packed (N, K/2) uint8, scale and low (N, G) float32 -> y (M, N) float32
torch::Tensor gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor low,
                   int64_t group) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && packed.dtype() == torch::kUInt8 && scale.dtype() == torch::kFloat32
              && low.dtype() == torch::kFloat32, "mt_gemv::int4: float32 x, scale, low; uint8 packed");
  x = x.contiguous(), packed = packed.contiguous(), scale = scale.contiguous(), low = low.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), G = K / group;
  const int64_t chunk = group % 64 == 0 ? 64 : 32;
  auto y = torch::empty({M, N}, x.options());
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * G), xsum(M * G);
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x.data_ptr<float>() + m * K, K, group, chunk, xq.data() + m * K, dx.data() + m * G,
                 xsum.data() + m * G);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float *s = scale.data_ptr<float>(), *l = low.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; ++m)
        out[m * N + n] = row_dot(w + n * K / 2, s + n * G, l + n * G, xq.data() + m * K, dx.data() + m * G,
                                 xsum.data() + m * G, G, group, chunk);
  });
  return y;
}

TORCH_LIBRARY(mt_gemv, m) {
  m.def("int4(Tensor x, Tensor packed, Tensor scale, Tensor low, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(mt_gemv, CPU, m) {
  m.impl("int4", &gemv);
}
"""


def kernel_groups_ok(group_size: int) -> bool:
    """The kernel walks a group in chunks of 64 inputs (or 32 for group 32)."""
    return group_size == 32 or group_size % 64 == 0


def int4_gemv_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """x (M, K) float32, packed (N, K/2) uint8, scale and low (N, G) -> (M, N) float32: the kernel's
    arithmetic in PyTorch. The integer dot products run as a float32 matmul, which is exact here: every
    product and partial sum is an integer below 15 * 127 * group_size < 2**24 (group_size <= 8192)."""
    M, K = x.shape
    N, G = packed.shape[0], K // group_size
    xg = x.view(M, G, group_size)  # (M, G, group)
    dx = xg.abs().amax(dim=-1) / 127  # (M, G)
    xq = torch.where(dx[..., None] == 0, 0.0, torch.round(xg / dx[..., None]))  # (M, G, group) integers
    q = torch.stack([packed & 15, packed >> 4], dim=-1).view(N, G, group_size).float()  # (N, G, group) codes
    dot = torch.einsum("mgk,ngk->mng", xq, q)  # (M, N, G) exact integers
    return (scale * dx[:, None] * dot).sum(dim=-1) + xg.sum(dim=-1) @ low.T  # (M, N)


@cache
def kernel_available() -> bool:
    """Build and load the C++ kernel (first call in a process); False where it cannot be built or
    MT_NATIVE_KERNELS=0 asks for the PyTorch reference."""
    if not build("mt_gemv", _SOURCE, "int4 GEMV"):
        return False
    torch.library.register_fake("mt_gemv::int4")(_gemv_shape)
    return True


def _gemv_shape(x, weight, scale, other, group_size):
    return x.new_empty(x.shape[0], weight.shape[0])
