// What both CPU attention kernels share (paged_decode.cpp and one_query.cpp): scores_tile, weighted_sum, the
// online softmax step and attend_tile, one tile of keys through them; fp32 arithmetic for fp32 / bf16 / fp16
// keys and values. Each inner loop has a generic path in plain C++ (below) and a SIMD one of the same name
// with _simd for _generic: AVX-512 (attention_tile_avx512.h) or AVX2 (attention_tile_avx2.h), chosen by the
// compiler's own macros.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "exp_generic.h"

#if defined(__AVX512F__)
#include "attention_tile_avx512.h"
#define ATTENTION_TILE_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "attention_tile_avx2.h"
#define ATTENTION_TILE_SIMD 1
#endif
#ifdef ATTENTION_TILE_SIMD
#include "attention_tile_simd.h"
#endif

namespace {

constexpr int kLanes = 16;  // independent fp32 sums in the generic loops: the compiler may keep them in vectors

// q . k over D, q already fp32
template <typename T>
static inline float dot_generic(const float* q, const T* k, int64_t D) {
  float lanes[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += q[d + l] * static_cast<float>(k[d + l]);
  float sum = 0.f;
  for (; d < D; ++d) sum += q[d] * static_cast<float>(k[d]);
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// scores (heads, tile) of n keys: query head i's q . k, where k is the part (i / group) * D of key t's row
// k_base + rows[t], plus bias[t] where not null; each key row read once for all its query heads
template <typename T>
static inline void scores_tile_generic(const float* q, const T* k_base, const int64_t* rows, const float* bias,
                                       int64_t n, int64_t heads, int64_t group, int64_t D, float* scores,
                                       int64_t tile) {
  for (int64_t t = 0; t < n; ++t) {
    const T* k = k_base + rows[t];
    const float b = bias ? bias[t] : 0.f;
    for (int64_t i = 0; i < heads; ++i) scores[i * tile + t] = dot_generic(q + i * D, k + (i / group) * D, D) + b;
  }
}

// acc (D) += sum_t p[t] * v_t over n rows, v_t = v_base + rows[t] + offset; 64 floats of acc at a time are
// held in a local array for all n rows, so they can stay in registers
template <typename T>
static inline void weighted_sum_generic(float* acc, const float* p, const T* v_base, const int64_t* rows,
                                        int64_t offset, int64_t n, int64_t D) {
  constexpr int64_t kBlock = 64;
  for (int64_t d0 = 0; d0 < D; d0 += kBlock) {
    const int64_t width = std::min(kBlock, D - d0);
    float a[kBlock];
    std::memcpy(a, acc + d0, width * sizeof(float));
    for (int64_t t = 0; t < n; ++t) {
      const T* v = v_base + rows[t] + offset + d0;
      if (width == kBlock)  // a constant trip count: the compiler unrolls and vectorises this one
        for (int64_t d = 0; d < kBlock; ++d) a[d] += p[t] * static_cast<float>(v[d]);
      else
        for (int64_t d = 0; d < width; ++d) a[d] += p[t] * static_cast<float>(v[d]);
    }
    std::memcpy(acc + d0, a, width * sizeof(float));
  }
}

// x (n,) -> exp(x - max); returns their sum
static inline float exp_and_sum_generic(float* x, int64_t n, float max) {
  float lanes[kLanes] = {};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      x[t + l] = exp_generic(x[t + l] - max);
      lanes[l] += x[t + l];
    }
  float sum = 0.f;
  for (; t < n; ++t) {
    x[t] = exp_generic(x[t] - max);
    sum += x[t];
  }
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// Whether this build runs a SIMD tile loop (else the generic one): each attention kernel's `vectorized` op.
static inline bool attention_tile_vectorized() {
#ifdef ATTENTION_TILE_SIMD
  return true;
#else
  return false;
#endif
}

#ifdef ATTENTION_TILE_SIMD
template <typename T>
static inline void scores_tile(const float* q, const T* k_base, const int64_t* rows, const float* bias, int64_t n,
                               int64_t heads, int64_t group, int64_t D, float* scores, int64_t tile) {
  scores_tile_lanes<Lanes>(q, k_base, rows, bias, n, heads, group, D, scores, tile);
}
template <typename T>
static inline void weighted_sum(float* acc, const float* p, int64_t tile, int64_t heads, const T* v_base,
                                const int64_t* rows, int64_t offset, int64_t n, int64_t D) {
  weighted_sum_lanes<Lanes>(acc, p, tile, heads, v_base, rows, offset, n, D);
}
static inline float exp_and_sum(float* x, int64_t n, float max) { return exp_and_sum_simd(x, n, max); }
static inline float max_of(const float* x, int64_t n) { return max_simd(x, n); }
#else
template <typename T>
static inline void scores_tile(const float* q, const T* k_base, const int64_t* rows, const float* bias, int64_t n,
                               int64_t heads, int64_t group, int64_t D, float* scores, int64_t tile) {
  scores_tile_generic(q, k_base, rows, bias, n, heads, group, D, scores, tile);
}
template <typename T>
static inline void weighted_sum(float* acc, const float* p, int64_t tile, int64_t heads, const T* v_base,
                                const int64_t* rows, int64_t offset, int64_t n, int64_t D) {
  for (int64_t h = 0; h < heads; ++h) weighted_sum_generic(acc + h * D, p + h * tile, v_base, rows, offset, n, D);
}
static inline float exp_and_sum(float* x, int64_t n, float max) { return exp_and_sum_generic(x, n, max); }
static inline float max_of(const float* x, int64_t n) { return *std::max_element(x, x + n); }
#endif

// The online softmax's step for one query head and one block of scores x (n,): x becomes exp(x - m'),
// the running max m becomes m', the running sum l takes the block's weights; returns exp(m - m'), the factor
// by which everything accumulated before this block must shrink.
static inline float online_softmax_step(float* x, int64_t n, float& m, float& l) {
  const float new_m = std::max(m, max_of(x, n));
  const float sum = exp_and_sum(x, n, new_m);
  const float rescale = m == new_m ? 1.f : std::exp(m - new_m);  // 0 for the first block (m = -inf)
  l = l * rescale + sum;
  m = new_m;
  return rescale;
}

// One tile of n keys through the online softmax, for `heads` query heads q (heads, D) fp32 pre-scaled, each
// with its state m, l, acc (D). Key t's K row starts at k_base + rows[t] and its V row at v_base + rows[t];
// query head i reads the part (i / group) * D of them (heads a multiple of group); bias (n,) is added to the
// scores where not null.
// Both kernels walk their keys tile by tile through this: the paged one a block, the contiguous one a run
// of unmasked keys.
template <typename T>
static void attend_tile(const float* q, const T* k_base, const T* v_base, const int64_t* rows, const float* bias,
                        int64_t n, int64_t heads, int64_t group, int64_t D, float* m, float* l, float* acc,
                        float* scores, int64_t tile) {
  scores_tile(q, k_base, rows, bias, n, heads, group, D, scores, tile);  // scores (heads, n)
  for (int64_t i = 0; i < heads; ++i) {  // scores -> weights; shrink what came before if the max grew
    const float rescale = online_softmax_step(scores + i * tile, n, m[i], l[i]);
    if (rescale != 1.f)
      for (int64_t d = 0; d < D; ++d) acc[i * D + d] *= rescale;
  }
  for (int64_t i = 0; i < heads; i += group)  // acc += weights @ V, the group's query heads over their V rows
    weighted_sum(acc + i * D, scores + i * tile, tile, group, v_base, rows, (i / group) * D, n, D);
}

}  // namespace
