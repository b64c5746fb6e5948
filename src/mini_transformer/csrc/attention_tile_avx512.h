// The AVX-512 path of attention_tile.h: 16 fp32 lanes per instruction, 16-bit keys and values widened as they
// load. Included only where the compiler has AVX-512 F.
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

// scores (heads, tile) of n keys, 16 keys at a time per query head: 16 independent sums (no FMA waits on
// the one before), one per key, reduced together by sum16x16. Key rows past n repeat the chunk's first (real
// rows, their scores never stored). The tail past the last 16 floats of D goes one value at a time.
template <typename T>
static inline void scores_tile_simd(const float* q, const T* k_base, const int64_t* rows, const float* bias,
                                    int64_t n, int64_t heads, int64_t group, int64_t D, float* scores, int64_t tile) {
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t width = std::min<int64_t>(16, n - t0);
    const __mmask16 live = width == 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
    const T* k[16];  // the chunk's key rows
    for (int j = 0; j < 16; ++j) k[j] = k_base + rows[t0 + (j < width ? j : 0)];
    const __m512 b = bias ? _mm512_maskz_loadu_ps(live, bias + t0) : _mm512_setzero_ps();
    for (int64_t i = 0; i < heads; ++i) {
      const float* qi = q + i * D;
      const int64_t kv = (i / group) * D;  // where this head's kv head starts in a row
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        const __m512 qd = _mm512_loadu_ps(qi + d);
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qd, load16(k[j] + kv + d), acc[j]);
      }
      float tail[16] = {};
      for (; d < D; ++d)
        for (int64_t j = 0; j < width; ++j) tail[j] += qi[d] * static_cast<float>(k[j][kv + d]);
      const __m512 s = _mm512_add_ps(_mm512_add_ps(sum16x16(acc), _mm512_loadu_ps(tail)), b);
      _mm512_mask_storeu_ps(scores + i * tile + t0, live, s);
    }
  }
}

// acc (G, D) += p (G, tile) @ V over n rows for G query heads of one kv head, v_t = v_base + rows[t] + offset.
// Each 16 floats of a V row are loaded once for all G heads, and 64 floats of each head's acc stay in registers
// for all n rows (written back once, not once per row: a store-then-load of acc per row would be the loop's
// critical path); G <= 4, so 4 x G sums, the row's 4 vectors and G weights fit the 32 registers.
template <int G, typename T>
static inline void weighted_sum_heads_avx512(float* acc, const float* p, int64_t tile, const T* v_base,
                                             const int64_t* rows, int64_t offset, int64_t n, int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    __m512 a[G][4];
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < 4; ++j) a[h][j] = _mm512_loadu_ps(acc + h * D + d + 16 * j);
    for (int64_t t = 0; t < n; ++t) {
      const T* v = v_base + rows[t] + offset + d;
      __m512 w[G];
      for (int h = 0; h < G; ++h) w[h] = _mm512_set1_ps(p[h * tile + t]);
      for (int j = 0; j < 4; ++j) {
        const __m512 vj = load16(v + 16 * j);
        for (int h = 0; h < G; ++h) a[h][j] = _mm512_fmadd_ps(w[h], vj, a[h][j]);
      }
    }
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + h * D + d + 16 * j, a[h][j]);
  }
  for (; d + 16 <= D; d += 16)
    for (int h = 0; h < G; ++h) {
      __m512 a = _mm512_loadu_ps(acc + h * D + d);
      for (int64_t t = 0; t < n; ++t)
        a = _mm512_fmadd_ps(_mm512_set1_ps(p[h * tile + t]), load16(v_base + rows[t] + offset + d), a);
      _mm512_storeu_ps(acc + h * D + d, a);
    }
  for (; d < D; ++d)
    for (int h = 0; h < G; ++h)
      for (int64_t t = 0; t < n; ++t)
        acc[h * D + d] += p[h * tile + t] * static_cast<float>(v_base[rows[t] + offset + d]);
}

// weighted_sum_heads_avx512 for any number of query heads sharing the kv head at offset, 4 at a time
template <typename T>
static inline void weighted_sum_simd(float* acc, const float* p, int64_t tile, int64_t heads, const T* v_base,
                                     const int64_t* rows, int64_t offset, int64_t n, int64_t D) {
  for (int64_t h = 0; h < heads; h += 4) {
    float* a = acc + h * D;
    const float* ph = p + h * tile;
    switch (std::min<int64_t>(4, heads - h)) {
      case 4: weighted_sum_heads_avx512<4>(a, ph, tile, v_base, rows, offset, n, D); break;
      case 3: weighted_sum_heads_avx512<3>(a, ph, tile, v_base, rows, offset, n, D); break;
      case 2: weighted_sum_heads_avx512<2>(a, ph, tile, v_base, rows, offset, n, D); break;
      default: weighted_sum_heads_avx512<1>(a, ph, tile, v_base, rows, offset, n, D);
    }
  }
}

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
