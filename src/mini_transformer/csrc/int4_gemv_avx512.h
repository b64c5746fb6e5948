// The AVX512-VNNI path of int4_gemv.cpp: per 128 inputs, 64 packed bytes are loaded once, split into low and
// high nibbles, and each half meets its 64 int8 activations in one vpdpbusd (64 u8 x s8 products summed into
// 16 int32 lanes). Included only where the compiler has AVX512-VNNI, BW and VL, by int4_gemv.cpp (which defines
// prefetch_ahead before it).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace {

// quantize_row for the VNNI loop, whose unit is 128 inputs in 2 blocks of 64 (group 64 or 128k): the codes go
// evens of block 0, evens of block 1, odds of block 0, odds of block 1. 16 values per instruction: the same
// codes as the generic loop's (x / d rounded to nearest even, as std::nearbyint in the default rounding mode;
// the evens and odds of each 32 inputs picked apart by one two-register permute each); each group's sum in
// another order (lanes, then across). It runs once per activation row per matmul, so it is vectorised too.
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
  // each byte shifted right by 4 in one instruction (an affine map over GF(2): output bit i = input bit i + 4),
  // where a 16-bit shift plus a mask takes two
  const __m512i hi = _mm512_gf2p8affine_epi64_epi8(b, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
  const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
#endif
  dot = _mm512_dpbusd_epi32(dot, lo, _mm512_loadu_si512((const void*)xq));
  return _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512((const void*)(xq + 64)));
}

// Group 64, K a multiple of 128: R weight rows (row strides K/2 bytes and 2G floats) against one activation row,
// y[r] for each. The 128 inputs of an iteration are two groups g0, g1: the int32 lanes 0-7 of a row's
// dot hold g0's partial sums, 8-15 g1's. Their scales s0 s1 (sl is (G, 2): s0 l0 s1 l1 in one 16-byte load) go
// to lanes 0-7 and 8-15 and meet dx[g0], dx[g1] (dxv, once per activation row). Each load of the activations
// serves the R rows. The minimums' term, sum_g low[g] * xsum[g], is one FMA per 16 floats of a row's (G, 2)
// array against xsl = 0 xsum0 0 xsum1 ..., after the loop. A row's arithmetic is the same for any R.
template <int R>
static void rows_dot_vnni64(const uint8_t* w, const float* sl, const int8_t* xq, const float* dxv, const float* xsl,
                            int64_t K, float* y) {
  const int64_t G2 = K / 32;  // floats of a row's (G, 2) scales and minimums
  const __m512i pick = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 128) {
    const __m512 d = _mm512_loadu_ps(dxv + k / 8);
    for (int r = 0; r < R; ++r) {
      const uint8_t* wr = w + r * K / 2 + k / 2;
      const float* sr = sl + r * G2 + k / 32;
      prefetch_ahead(wr, sr);
      const __m512i dot = dot128(wr, xq + k, _mm512_setzero_si512());
      const __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_loadu_ps(sr))), d);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 low = _mm512_setzero_ps();
    for (int64_t j = 0; j < G2; j += 16) {
      const __mmask16 lanes = G2 - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G2 - j)) - 1u);
      low = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, sl + r * G2 + j), _mm512_maskz_loadu_ps(lanes, xsl + j), low);
    }
    y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], low));
  }
}

// Groups of 128k, K a multiple of 128: one weight row, per group the integer dot over its 128-input steps, then
// one multiply-add by the weight's scale times the activations' dx, plus low x xsum.
static float row_dot_vnni(const uint8_t* w, const float* sl, const int8_t* xq, const float* dx, const float* xsum,
                          int64_t G, int64_t group) {
  __m512 acc = _mm512_setzero_ps();
  float y = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot = _mm512_setzero_si512();
    for (int64_t k = g * group; k < (g + 1) * group; k += 128) {
      prefetch_ahead(w + k / 2, sl + 2 * g);
      dot = dot128(w + k / 2, xq + k, dot);
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(sl[2 * g] * dx[g]), acc);
    y += sl[2 * g + 1] * xsum[g];
  }
  return y + _mm512_reduce_add_ps(acc);
}

}  // namespace
