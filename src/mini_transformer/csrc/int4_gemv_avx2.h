// The AVX2 path of int4_gemv.cpp, for groups of 64k: per 64 inputs, 32 packed bytes are loaded once, split into
// low and high nibbles, and each half meets its 32 int8 activations (the generic loop's order: evens, then
// odds) in one vpmaddubsw (u8 x s8 products added in pairs to int16), then vpmaddwd against ones (pairs of
// int16 to 8 int32 lanes). Included where the compiler has AVX2 and FMA, by int4_gemv.cpp (which defines
// prefetch_ahead before it); with AVX512-VNNI too it takes only the shapes the VNNI loop does not.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace {

// The integer dot of 64 inputs (32 packed bytes at w; their 64 activation codes in x0, x1: evens, then odds) in
// 8 int32 lanes. Each int16 sum is at most 2 x (15 x 127) per vpmaddubsw and two of them are added: 7620 < 2^15,
// so nothing saturates and the sums are exact.
static inline __m256i dot64_avx2(const uint8_t* w, __m256i x0, __m256i x1) {
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256i b = _mm256_loadu_si256((const __m256i*)w);
  const __m256i lo = _mm256_and_si256(b, nibble);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

static inline float sum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// R weight rows (row strides K/2 bytes and 2G floats; G groups of `group` inputs, group a multiple of 64) against
// one activation row, y[r] for each: per group the integer dot, scaled by the weight's scale times the
// activations' (dx), plus the weight's minimum times the activations' sum. Each load of the activation codes
// serves the R rows; a row's arithmetic is the same for any R.
template <int R>
static void rows_dot_avx2(const uint8_t* w, const float* sl, const int8_t* xq, const float* dx, const float* xsum,
                          int64_t G, int64_t group, float* y) {
  const int64_t K = G * group;
  __m256 acc[R];
  float low[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), low[r] = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    __m256i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
    for (int64_t k = g * group; k < (g + 1) * group; k += 64) {
      const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + k));
      const __m256i x1 = _mm256_loadu_si256((const __m256i*)(xq + k + 32));
      for (int r = 0; r < R; ++r) {
        prefetch_ahead(w + r * K / 2 + k / 2, sl + r * 2 * G + 2 * g);
        dot[r] = _mm256_add_epi32(dot[r], dot64_avx2(w + r * K / 2 + k / 2, x0, x1));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* s = sl + r * 2 * G + 2 * g;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_set1_ps(s[0] * dx[g]), acc[r]);
      low[r] += s[1] * xsum[g];
    }
  }
  for (int r = 0; r < R; ++r) y[r] = sum8(acc[r]) + low[r];
}

}  // namespace
