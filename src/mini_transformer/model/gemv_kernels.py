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
    128 inputs, 64 packed bytes are loaded once, split into low and high nibbles, and each half meets
    its 64 int8 activations in ONE `vpdpbusd` (AVX512-VNNI: 64 u8 x s8 products summed into 16 int32
    lanes). The packed layout is the one Int4Linear saves: byte j of a row holds inputs 2j (low nibble)
    and 2j+1 (high), so the activations are reordered instead (evens, then odds).
It is registered as the operator `mt_gemv::int4`, so a compiled decode step calls it like any aten op.

Bytes per row, one stream: a row's (G, 2) scale and low sit side by side (`scale_low`, Int4Linear's
`gemv_scale_low`), not in two (N, G) arrays. Measured on the 61 int4 matrices of a 124.7M Llama
(62.5 MB, 1 thread, same process): scale and low as two arrays 2.96 ms (21 GB/s); side by side
2.24 ms (28 GB/s); side by side in float16 also 2.24 ms (10% fewer bytes, no faster: so they stay float32
and the kernel's weights are exactly Int4Linear's). Two rows per iteration (shared activation loads)
gave nothing more.

int8 weights do NOT go this way (yet): an int8 x int8 VNNI loop (activations rounded to int8 per 128,
|x| as u8 times the weights with x's sign, ggml's q8_0 x q8_0 idea) was 7-11% faster than inductor's fused
int8 -> float reduction on the Llama's 61 int8 matrices (100.5 MB: 3.97 against 4.27 ms, same process), but
it adds activation rounding (~1% relative error per output, and compiled/eager tokens that part at near
ties, as int4's do); int8 keeps the compiled reduction (quantize.py). docs/08 has the numbers.
"""

from __future__ import annotations

from functools import cache

import torch

from .._native import build

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define MT_VNNI 1
#endif

// One activation row, quantized per group: dx (G,) the group scales, xsum (G,) each group's float sum,
// xq (K,) the int8 codes in the order the dot products read them. The plain loop reads `unit` (64 or 32)
// inputs at a time, packed as bytes of (even, odd) input pairs: so within a unit the codes go evens, then odds.
static void quantize_row(const float* x, int64_t K, int64_t group, int64_t unit, int8_t* xq, float* dx,
                         float* xsum) {
  for (int64_t g = 0; g < K / group; ++g) {
    float amax = 0.f, s = 0.f;
    for (int64_t k = g * group; k < (g + 1) * group; ++k) { amax = std::max(amax, std::fabs(x[k])); s += x[k]; }
    dx[g] = amax / 127.f;
    xsum[g] = s;
  }
  for (int64_t u = 0; u < K; u += unit) {
    const float d = dx[u / group];  // a unit lies inside one group
    for (int64_t j = 0; j < unit / 2; ++j) {
      xq[u + j] = d == 0.f ? 0 : (int8_t)std::nearbyint(x[u + 2 * j] / d);
      xq[u + unit / 2 + j] = d == 0.f ? 0 : (int8_t)std::nearbyint(x[u + 2 * j + 1] / d);
    }
  }
}

// Any group size: one weight row, plain loops (units of `chunk` inputs). sl (G, 2): each group's scale, low.
static float row_dot_scalar(const uint8_t* w, const float* sl, const int8_t* xq, const float* dx,
                            const float* xsum, int64_t G, int64_t group, int64_t chunk) {
  float y = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    int32_t dot = 0;
    for (int64_t c = g * group; c < (g + 1) * group; c += chunk)
      for (int64_t j = 0; j < chunk / 2; ++j)
        dot += (int32_t)(w[c / 2 + j] & 15) * xq[c + j] + (int32_t)(w[c / 2 + j] >> 4) * xq[c + chunk / 2 + j];
    y += sl[2 * g] * dx[g] * (float)dot + sl[2 * g + 1] * xsum[g];
  }
  return y;
}

#ifdef MT_VNNI
// quantize_row for the VNNI loop, whose unit is 128 inputs in 2 blocks of 64 (group 64 or 128k): the codes go
// evens of block 0, evens of block 1, odds of block 0, odds of block 1. 16 values per instruction: the same
// codes as the plain loop's (x / d rounded to nearest even, as std::nearbyint in the default rounding mode;
// the evens and odds of each 32 inputs picked apart by one two-register permute each); each group's sum in
// another order (lanes, then across). Called once per activation row per matmul, 61 times per decode step: the
// scalar loop cost ~2 us per call there.
static void quantize_row_vnni(const float* x, int64_t K, int64_t group, int8_t* xq, float* dx, float* xsum) {
  for (int64_t g = 0; g < K / group; ++g) {
    __m512 amax = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
      const __m512 v = _mm512_loadu_ps(x + k);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      sum = _mm512_add_ps(sum, v);
    }
    dx[g] = _mm512_reduce_max_ps(amax) / 127.f;
    xsum[g] = _mm512_reduce_add_ps(sum);
  }
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t u = 0; u < K; u += 128)
    for (int64_t b = 0; b < 2; ++b) {
      const float d = dx[(u + 64 * b) / group];
      const __m512 dv = _mm512_set1_ps(d);
      int8_t* evens = xq + u + 32 * b;  // block b's evens; its odds 64 further
      for (int64_t h = 0; h < 2; ++h) {  // 32 inputs -> 16 evens, 16 odds
        const float* xh = x + u + 64 * b + 32 * h;
        const __m512 lo = _mm512_loadu_ps(xh), hi = _mm512_loadu_ps(xh + 16);
        __m512i e = _mm512_setzero_si512(), o = _mm512_setzero_si512();
        if (d != 0.f) {
          e = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_permutex2var_ps(lo, even, hi), dv));
          o = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_permutex2var_ps(lo, odd, hi), dv));
        }
        _mm_storeu_si128((__m128i*)(evens + 16 * h), _mm512_cvtsepi32_epi8(e));
        _mm_storeu_si128((__m128i*)(evens + 64 + 16 * h), _mm512_cvtsepi32_epi8(o));
      }
    }
}

static inline __m512i dot128(const uint8_t* w, const int8_t* xq, __m512i dot) {
  const __m512i nibble = _mm512_set1_epi8(15);
  const __m512i b = _mm512_loadu_si512((const void*)w);
  const __m512i lo = _mm512_and_si512(b, nibble);
#ifdef __GFNI__
  // each byte shifted right by 4 in ONE instruction (an affine map over GF(2): output bit i = input bit i + 4),
  // where a 16-bit shift plus a mask took two
  const __m512i hi = _mm512_gf2p8affine_epi64_epi8(b, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
  const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
#endif
  dot = _mm512_dpbusd_epi32(dot, lo, _mm512_loadu_si512((const void*)xq));
  return _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512((const void*)(xq + 64)));
}

// K a multiple of 128 and groups of 128k, or of 64: then the 128 inputs of an iteration are two groups g0, g1,
// and the int32 lanes 0-7 of `dot` hold g0's partial sums, 8-15 g1's. Their four floats, s0 l0 s1 l1, are
// one 16-byte load (sl is (G, 2)); lanes 0-7 get s0 * dx[g0], 8-15 s1 * dx[g1] (dxv, once per activation
// row), and l0 * xsum0 + l1 * xsum1 is one FMA of s0 l0 s1 l1 with xsv = 0 xsum0 0 xsum1 (lanes 4-15 zero).
static float row_dot_vnni(const uint8_t* w, const float* sl, const int8_t* xq, const float* dx, const float* dxv,
                          const float* xsv, const float* xsum, int64_t K, int64_t G, int64_t group) {
  __m512 acc = _mm512_setzero_ps(), acc_low = _mm512_setzero_ps();
  if (group == 64) {
    const __m512i pick = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t k = 0; k < K; k += 128) {
      const __m512i dot = dot128(w + k / 2, xq + k, _mm512_setzero_si512());
      // scale, low of the two groups, (4,) repeated: s0 l0 s1 l1 s0 l0 ...
      const __m512 s_l = _mm512_broadcast_f32x4(_mm_loadu_ps(sl + k / 32));
      const __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(pick, s_l), _mm512_loadu_ps(dxv + k / 8));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc);
      acc_low = _mm512_fmadd_ps(s_l, _mm512_loadu_ps(xsv + k / 8), acc_low);  // l0 * xsum0 + l1 * xsum1
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc, acc_low));
  }
  float y = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot = _mm512_setzero_si512();
    for (int64_t k = g * group; k < (g + 1) * group; k += 128) dot = dot128(w + k / 2, xq + k, dot);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(sl[2 * g] * dx[g]), acc);
    y += sl[2 * g + 1] * xsum[g];
  }
  return y + _mm512_reduce_add_ps(acc);
}
#endif

// x (M, K) float32, packed (N, K/2) uint8, scale_low (N, G, 2) float32 -> y (M, N) float32
torch::Tensor gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_low, int64_t group) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && packed.dtype() == torch::kUInt8 && scale_low.dtype() == torch::kFloat32,
              "mt_gemv::int4: float32 x, uint8 packed, float32 scale_low");
  x = x.contiguous(), packed = packed.contiguous(), scale_low = scale_low.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), G = K / group;
  const int64_t chunk = group % 64 == 0 ? 64 : 32;
#ifdef MT_VNNI
  const bool vnni = group % 64 == 0 && K % 128 == 0;
#else
  const bool vnni = false;
#endif
  auto y = torch::empty({M, N}, x.options());
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * G), xsum(M * G), dxv(vnni ? M * K / 8 : 0), xsv(vnni ? M * K / 8 : 0);
  for (int64_t m = 0; m < M; ++m) {
#ifdef MT_VNNI
    if (vnni)
      quantize_row_vnni(x.data_ptr<float>() + m * K, K, group, xq.data() + m * K, dx.data() + m * G,
                        xsum.data() + m * G);
    else
#endif
      quantize_row(x.data_ptr<float>() + m * K, K, group, chunk, xq.data() + m * K, dx.data() + m * G,
                   xsum.data() + m * G);
    for (int64_t k = 0; vnni && k < K; k += 64) {
      const int64_t g = m * G + k / group, half = (k / 64) % 2;  // 64 inputs: the first or second of their 128
      for (int64_t i = 0; i < 8; ++i) dxv[m * K / 8 + k / 8 + i] = dx[g];
      xsv[m * K / 8 + (k - 64 * half) / 8 + 2 * half + 1] = group == 64 ? xsum[g] : 0.f;
    }
  }
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* sl = scale_low.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xm = xq.data() + m * K;
        const float *dm = dx.data() + m * G, *sm = xsum.data() + m * G;
#ifdef MT_VNNI
        if (vnni) {
          out[m * N + n] = row_dot_vnni(w + n * K / 2, sl + n * 2 * G, xm, dm, dxv.data() + m * K / 8,
                                        xsv.data() + m * K / 8, sm, K, G, group);
          continue;
        }
#endif
        out[m * N + n] = row_dot_scalar(w + n * K / 2, sl + n * 2 * G, xm, dm, sm, G, group, chunk);
      }
  });
  return y;
}

TORCH_LIBRARY(mt_gemv, m) {
  m.def("int4(Tensor x, Tensor packed, Tensor scale_low, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(mt_gemv, CPU, m) {
  m.impl("int4", &gemv);
}
"""


def kernel_groups_ok(group_size: int) -> bool:
    """The kernel walks a group in chunks of 64 inputs (or 32 for group 32)."""
    return group_size == 32 or group_size % 64 == 0


def int4_gemv_reference(x: torch.Tensor, packed: torch.Tensor, scale_low: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """x (M, K) float32, packed (N, K/2) uint8, scale_low (N, G, 2) -> (M, N) float32: the kernel's
    arithmetic in PyTorch. The integer dot products run as a float32 matmul, which is exact here: every
    product and partial sum is an integer below 15 * 127 * group_size < 2**24 (group_size <= 8192)."""
    M, K = x.shape
    N, G = packed.shape[0], K // group_size
    scale, low = scale_low.unbind(-1)  # (N, G) each
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
    return build("mt_gemv", _SOURCE, "int4 GEMV", fakes={"mt_gemv::int4": _gemv_shape})


def _gemv_shape(x, weight, scale_low, group_size):
    return x.new_empty(x.shape[0], weight.shape[0])
