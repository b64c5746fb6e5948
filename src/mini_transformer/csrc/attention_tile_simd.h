// The SIMD loops of attention_tile.h, written once over a register type R (attention_tile_avx512.h's or
// attention_tile_avx2.h's Lanes): R::L fp32 lanes, R::load widening a pool element, R::live(n) the mask of the
// first n lanes, R::sum_lanes the transpose-and-add tree, R::kMaxHeads the query heads one V row serves at once.
#pragma once
#include <algorithm>
#include <cstdint>

namespace {

// scores (heads, tile) of n keys, L keys at a time per query head: L independent sums (no FMA waits on the one
// before), one per key, reduced together by R::sum_lanes. Key rows past n repeat the chunk's first (real rows,
// their scores never stored). The tail past the last L floats of D goes one value at a time.
template <class R, typename T>
static inline void scores_tile_lanes(const float* q, const T* k_base, const int64_t* rows, const float* bias,
                                     int64_t n, int64_t heads, int64_t group, int64_t D, float* scores, int64_t tile) {
  constexpr int L = R::L;
  using V = typename R::V;
  for (int64_t t0 = 0; t0 < n; t0 += L) {
    const int64_t width = std::min<int64_t>(L, n - t0);
    const auto live = R::live(width);
    const T* k[L];  // the chunk's key rows
    for (int j = 0; j < L; ++j) k[j] = k_base + rows[t0 + (j < width ? j : 0)];
    const V b = bias ? R::load_live(bias + t0, live) : R::zero();
    for (int64_t i = 0; i < heads; ++i) {
      const float* qi = q + i * D;
      const int64_t kv = (i / group) * D;  // where this head's kv head starts in a row
      V acc[L];
      for (int j = 0; j < L; ++j) acc[j] = R::zero();
      int64_t d = 0;
      for (; d + L <= D; d += L) {
        const V qd = R::load(qi + d);
        for (int j = 0; j < L; ++j) acc[j] = R::fmadd(qd, R::load(k[j] + kv + d), acc[j]);
      }
      float tail[L] = {};
      for (; d < D; ++d)
        for (int64_t j = 0; j < width; ++j) tail[j] += qi[d] * static_cast<float>(k[j][kv + d]);
      R::store_live(scores + i * tile + t0, live, R::add(R::add(R::sum_lanes(acc), R::load(tail)), b));
    }
  }
}

// acc (G, D) += p (G, tile) @ V over n rows for G <= R::kMaxHeads query heads of one kv head, v_t = v_base +
// rows[t] + offset. Each L floats of a V row are loaded once for all G heads, and 4L floats of each head's acc
// stay in registers for all n rows (written back once, not once per row: a store-then-load of acc per row would
// be the loop's critical path): 4 x G sums, the row's vectors and G weights fit the registers.
template <class R, int G, typename T>
static inline void weighted_sum_heads(float* acc, const float* p, int64_t tile, const T* v_base, const int64_t* rows,
                                      int64_t offset, int64_t n, int64_t D) {
  constexpr int L = R::L;
  using V = typename R::V;
  int64_t d = 0;
  for (; d + 4 * L <= D; d += 4 * L) {
    V a[G][4];
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < 4; ++j) a[h][j] = R::load(acc + h * D + d + L * j);
    for (int64_t t = 0; t < n; ++t) {
      const T* v = v_base + rows[t] + offset + d;
      V w[G];
      for (int h = 0; h < G; ++h) w[h] = R::set1(p[h * tile + t]);
      for (int j = 0; j < 4; ++j) {
        const V vj = R::load(v + L * j);
        for (int h = 0; h < G; ++h) a[h][j] = R::fmadd(w[h], vj, a[h][j]);
      }
    }
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < 4; ++j) R::store(acc + h * D + d + L * j, a[h][j]);
  }
  for (; d + L <= D; d += L)
    for (int h = 0; h < G; ++h) {
      V a = R::load(acc + h * D + d);
      for (int64_t t = 0; t < n; ++t) a = R::fmadd(R::set1(p[h * tile + t]), R::load(v_base + rows[t] + offset + d), a);
      R::store(acc + h * D + d, a);
    }
  for (; d < D; ++d)
    for (int h = 0; h < G; ++h)
      for (int64_t t = 0; t < n; ++t)
        acc[h * D + d] += p[h * tile + t] * static_cast<float>(v_base[rows[t] + offset + d]);
}

// weighted_sum_heads<R, g> for the g <= G heads left, G the largest
template <class R, int G, typename T>
static inline void weighted_sum_first(int64_t g, float* acc, const float* p, int64_t tile, const T* v_base,
                                      const int64_t* rows, int64_t offset, int64_t n, int64_t D) {
  if constexpr (G > 1)
    if (g < G) return weighted_sum_first<R, G - 1>(g, acc, p, tile, v_base, rows, offset, n, D);
  weighted_sum_heads<R, G>(acc, p, tile, v_base, rows, offset, n, D);
}

// weighted_sum_heads for any number of query heads sharing the kv head at offset, R::kMaxHeads at a time
template <class R, typename T>
static inline void weighted_sum_lanes(float* acc, const float* p, int64_t tile, int64_t heads, const T* v_base,
                                      const int64_t* rows, int64_t offset, int64_t n, int64_t D) {
  for (int64_t h = 0; h < heads; h += R::kMaxHeads)
    weighted_sum_first<R, R::kMaxHeads>(std::min<int64_t>(R::kMaxHeads, heads - h), acc + h * D, p + h * tile,
                                        tile, v_base, rows, offset, n, D);
}

}  // namespace
