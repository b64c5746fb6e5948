// The AVX-512 path of attention_tile.h: 16 fp32 lanes per instruction, 16-bit keys and values widened as they
// load; its register type runs the loops of attention_tile_simd.h. Included only where the compiler has AVX-512 F.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// 16 pool elements widened to 16 fp32 lanes
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {  // bf16 is the top half of an fp32
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// e^x in 16 lanes: e^x = 2^k e^r with k = round(x / ln 2) and r = x - k ln 2 (|r| <= ln 2 / 2, ln 2 in two
// parts so r is exact); e^r by its Taylor series to degree 7 (error below fp32's), 2^k by scalef.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // e^-104 is 0 in fp32 already
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);  // Horner: 1 + r + r^2/2! + ... + r^7/7!
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, k);
}

// 16 vectors -> one: lane j of the result is the sum of v[j]'s 16 lanes. A transpose-and-add tree: each level
// shuffles pairs of vectors so that their halves line up, then adds them, halving the vector count (16 -> 8 -> 4
// -> 2 -> 1) and the lanes each sum still spans; 45 instructions for 16 sums, where 16 horizontal reductions
// would take ~8 each, one after the other.
static inline __m512 sum16x16(const __m512* v) {
  __m512 two[8], four[4];
  for (int j = 0; j < 8; ++j)  // in each 4-lane group: v[2j] lanes 0+2, v[2j+1] 0+2, v[2j] 1+3, v[2j+1] 1+3
    two[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // in each 4-lane group: the group's sums of v[4j], ..., v[4j + 3]
    const __m512d a = _mm512_castps_pd(two[2 * j]), b = _mm512_castps_pd(two[2 * j + 1]);
    four[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // then across the four 4-lane groups: groups 0 + 1 and 2 + 3 (0x88 picks groups 0, 2 of each, 0xDD 1, 3)
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(four[0], four[1], 0x88),
                                  _mm512_shuffle_f32x4(four[0], four[1], 0xDD));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(four[2], four[3], 0x88),
                                  _mm512_shuffle_f32x4(four[2], four[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
}

// attention_tile_simd.h's register type: 16 fp32 lanes; 32 registers let one V row serve 4 query heads
struct Lanes {
  using V = __m512;
  static constexpr int L = 16, kMaxHeads = 4;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  template <typename T>
  static V load(const T* p) { return load16(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static __mmask16 live(int64_t n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }
  static V load_live(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store_live(float* p, __mmask16 m, V v) { _mm512_mask_storeu_ps(p, m, v); }
  static V sum_lanes(const V* v) { return sum16x16(v); }
};

// the largest of x (n,), 16 at a time, the lanes past n masked off
static inline float max_simd(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 live = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
    m = _mm512_mask_max_ps(m, live, m, _mm512_maskz_loadu_ps(live, x + t));
  }
  return _mm512_reduce_max_ps(m);
}

// x (n,) -> exp(x - max), 16 scores at a time, the lanes past n masked off; returns their sum
static inline float exp_and_sum_simd(float* x, int64_t n, float max) {
  float sum = 0.f;
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 live = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
    const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, x + t), _mm512_set1_ps(max)));
    _mm512_mask_storeu_ps(x + t, live, p);
    sum += _mm512_mask_reduce_add_ps(live, p);
  }
  return sum;
}

}  // namespace
