// The AVX2 path of attention_tile.h: attention_tile_avx512.h's loops with 8 fp32 lanes per instruction and half
// the registers (16): 8 keys scored at a time, V summed for 2 query heads at a time. AVX2 has no masked loads
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

// scores (heads, tile) of n keys, 8 keys at a time per query head: 8 independent sums, one per key, reduced
// together by sum8x8. Key rows past n repeat the chunk's first (real rows, their scores never stored). The tail
// past the last 8 floats of D goes one value at a time.
template <typename T>
static inline void scores_tile_simd(const float* q, const T* k_base, const int64_t* rows, const float* bias,
                                    int64_t n, int64_t heads, int64_t group, int64_t D, float* scores, int64_t tile) {
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const int64_t width = std::min<int64_t>(8, n - t0);
    const __m256i live = live8(width);
    const T* k[8];  // the chunk's key rows
    for (int j = 0; j < 8; ++j) k[j] = k_base + rows[t0 + (j < width ? j : 0)];
    const __m256 b = bias ? _mm256_maskload_ps(bias + t0, live) : _mm256_setzero_ps();
    for (int64_t i = 0; i < heads; ++i) {
      const float* qi = q + i * D;
      const int64_t kv = (i / group) * D;  // where this head's kv head starts in a row
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(qi + d);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qd, load8(k[j] + kv + d), acc[j]);
      }
      float tail[8] = {};
      for (; d < D; ++d)
        for (int64_t j = 0; j < width; ++j) tail[j] += qi[d] * static_cast<float>(k[j][kv + d]);
      const __m256 s = _mm256_add_ps(_mm256_add_ps(sum8x8(acc), _mm256_loadu_ps(tail)), b);
      _mm256_maskstore_ps(scores + i * tile + t0, live, s);
    }
  }
}

// acc (G, D) += p (G, tile) @ V over n rows for G <= 2 query heads of one kv head, v_t = v_base + rows[t] +
// offset: each 8 floats of a V row loaded once for the G heads, 32 floats of each head's acc in registers for
// all n rows (4 x G sums, the row's vector and G weights: 11 of the 16 registers).
template <int G, typename T>
static inline void weighted_sum_heads_avx2(float* acc, const float* p, int64_t tile, const T* v_base,
                                           const int64_t* rows, int64_t offset, int64_t n, int64_t D) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m256 a[G][4];
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < 4; ++j) a[h][j] = _mm256_loadu_ps(acc + h * D + d + 8 * j);
    for (int64_t t = 0; t < n; ++t) {
      const T* v = v_base + rows[t] + offset + d;
      __m256 w[G];
      for (int h = 0; h < G; ++h) w[h] = _mm256_set1_ps(p[h * tile + t]);
      for (int j = 0; j < 4; ++j) {
        const __m256 vj = load8(v + 8 * j);
        for (int h = 0; h < G; ++h) a[h][j] = _mm256_fmadd_ps(w[h], vj, a[h][j]);
      }
    }
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc + h * D + d + 8 * j, a[h][j]);
  }
  for (; d + 8 <= D; d += 8)
    for (int h = 0; h < G; ++h) {
      __m256 a = _mm256_loadu_ps(acc + h * D + d);
      for (int64_t t = 0; t < n; ++t)
        a = _mm256_fmadd_ps(_mm256_set1_ps(p[h * tile + t]), load8(v_base + rows[t] + offset + d), a);
      _mm256_storeu_ps(acc + h * D + d, a);
    }
  for (; d < D; ++d)
    for (int h = 0; h < G; ++h)
      for (int64_t t = 0; t < n; ++t)
        acc[h * D + d] += p[h * tile + t] * static_cast<float>(v_base[rows[t] + offset + d]);
}

// weighted_sum_heads_avx2 for any number of query heads sharing the kv head at offset, 2 at a time
template <typename T>
static inline void weighted_sum_simd(float* acc, const float* p, int64_t tile, int64_t heads, const T* v_base,
                                     const int64_t* rows, int64_t offset, int64_t n, int64_t D) {
  for (int64_t h = 0; h < heads; h += 2) {
    if (heads - h >= 2)
      weighted_sum_heads_avx2<2>(acc + h * D, p + h * tile, tile, v_base, rows, offset, n, D);
    else
      weighted_sum_heads_avx2<1>(acc + h * D, p + h * tile, tile, v_base, rows, offset, n, D);
  }
}

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
