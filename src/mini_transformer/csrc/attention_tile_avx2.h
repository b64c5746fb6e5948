// The AVX2 path of attention_tile.h: 8 fp32 lanes per instruction and half AVX-512's registers (16): 8 keys
// scored at a time, V summed for 2 query heads at a time (the loops: attention_tile_simd.h). AVX2 has no masked loads
// of 16-bit values, no scalef and no horizontal reductions, so the tails, 2^k and the sums are spelled out.
// Included only where the compiler has AVX2, FMA and F16C (and not AVX-512, which attention_tile_avx512.h takes).
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// 8 pool elements widened to 8 fp32 lanes
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// all ones in the lanes below n (n may exceed 8): the mask of the masked fp32 loads and stores
static inline __m256i live8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::min<int64_t>(n, 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// e^x in 8 lanes, exp16's arithmetic (range reduction, degree-7 series); 2^k built from its exponent bits as in
// exp_generic, so below -87 (where 2^k would leave fp32's normal range) the result is 0.
static inline __m256 exp8(__m256 x) {
  const __m256 y = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(y, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), y);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);  // Horner: 1 + r + r^2/2! + ... + r^7/7!
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_and_ps(e, _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ));
}

// 8 vectors -> one: lane j of the result is the sum of v[j]'s 8 lanes; sum16x16's transpose-and-add tree, with
// one level fewer (8 -> 4 -> 2 -> 1), the last across the two 128-bit halves.
static inline __m256 sum8x8(const __m256* v) {
  __m256 two[4], four[2];
  for (int j = 0; j < 4; ++j)  // per half: v[2j] lanes 0+2, v[2j+1] 0+2, v[2j] 1+3, v[2j+1] 1+3
    two[j] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm256_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 2; ++j) {  // per half: the half's sums of v[4j], ..., v[4j + 3]
    const __m256d a = _mm256_castps_pd(two[2 * j]), b = _mm256_castps_pd(two[2 * j + 1]);
    four[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(four[0], four[1], 0x20), _mm256_permute2f128_ps(four[0], four[1], 0x31));
}

// attention_tile_simd.h's register type: 8 fp32 lanes; 16 registers let one V row serve 2 query heads (4 x 2
// sums, the row's vector and 2 weights: 11 of them)
struct Lanes {
  using V = __m256;
  static constexpr int L = 8, kMaxHeads = 2;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  template <typename T>
  static V load(const T* p) { return load8(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256i live(int64_t n) { return live8(n); }
  static V load_live(const float* p, __m256i m) { return _mm256_maskload_ps(p, m); }
  static void store_live(float* p, __m256i m, V v) { _mm256_maskstore_ps(p, m, v); }
  static V sum_lanes(const V* v) { return sum8x8(v); }
};

// the largest of x (n,), 8 at a time, the lanes past n left at -inf
static inline float max_simd(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; t += 8) {
    const __m256i live = live8(n - t);
    m = _mm256_max_ps(m, _mm256_blendv_ps(m, _mm256_maskload_ps(x + t, live), _mm256_castsi256_ps(live)));
  }
  return hmax8(m);
}

// x (n,) -> exp(x - max), 8 scores at a time, the lanes past n zeroed and not stored; returns their sum
static inline float exp_and_sum_simd(float* x, int64_t n, float max) {
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; t += 8) {
    const __m256i live = live8(n - t);
    __m256 p = exp8(_mm256_sub_ps(_mm256_maskload_ps(x + t, live), _mm256_set1_ps(max)));
    p = _mm256_and_ps(p, _mm256_castsi256_ps(live));
    _mm256_maskstore_ps(x + t, live, p);
    sum = _mm256_add_ps(sum, p);
  }
  return hsum8(sum);
}

}  // namespace
