// The AVX-512 path of float_gemv.cpp: one element type per struct (how many values a register holds, a masked
// load, acc += x * w), and the rows loop over them. Included only where the compiler has AVX-512 F, BW and VL;
// bf16 also needs AVX512_BF16 (vdpbf16ps), else bf16 runs the generic loop.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
#define FLOAT_GEMV_AVX512_BF16 1
#endif

namespace {

constexpr int kPrefetchBytes = 2048;  // how far ahead of the loads the weight stream is asked for

struct F32 {
  using T = float;
  using V = __m512;
  static constexpr int L = 16;
  static V load(const T* p, int n) {
    return n == L ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
  }
  static __m512 madd(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};

struct F16 {  // widened to fp32 on load (vcvtph2ps), exact
  using T = c10::Half;
  using V = __m512;
  static constexpr int L = 16;
  static V load(const T* p, int n) {
    const __m256i h = n == L ? _mm256_loadu_si256((const __m256i*)p)
                             : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), p);
    return _mm512_cvtph_ps(h);
  }
  static __m512 madd(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};

#ifdef FLOAT_GEMV_AVX512_BF16
struct BF16 {  // pairs of products added into 16 fp32 lanes by vdpbf16ps
  using T = c10::BFloat16;
  using V = __m512bh;
  static constexpr int L = 32;
  static V load(const T* p, int n) {
    return (V)(n == L ? _mm512_loadu_si512((const void*)p) : _mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), p));
  }
  static __m512 madd(__m512 acc, V x, V w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#endif

// Weight rows [n0, n1) (w, stride K) against MR activation rows (x, stride K) -> y (MR, N), each sum + bias
// rounded once. A accumulators per activation row, so an add never waits for the one before it; each register
// of w is loaded once and used MR times.
template <class E, int MR>
static void rows_avx512(const typename E::T* x, const typename E::T* w, const typename E::T* bias,
                        typename E::T* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  using T = typename E::T;
  constexpr int A = 4, L = E::L;
  for (int64_t n = n0; n < n1; ++n) {
    const T* row = w + n * K;
    __m512 acc[MR][A];
    for (int m = 0; m < MR; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + A * L <= K; k += A * L) {  // full steps of A registers
      // ask for the weight stream kPrefetchBytes ahead (past this row's end: the next row follows it): the
      // hardware prefetcher alone keeps too few lines in flight for one core to reach its share of the bandwidth
      for (int line = 0; line < A * L * (int)sizeof(T); line += 64)
        _mm_prefetch((const char*)(row + k) + kPrefetchBytes + line, _MM_HINT_T0);
      for (int a = 0; a < A; ++a) {
        const typename E::V wv = E::load(row + k + a * L, L);
        for (int m = 0; m < MR; ++m) acc[m][a] = E::madd(acc[m][a], E::load(x + m * K + k + a * L, L), wv);
      }
    }
    for (; k < K; k += L) {  // the rest, one register at a time, the last one masked
      const int left = (int)std::min<int64_t>(L, K - k);
      const typename E::V wv = E::load(row + k, left);
      for (int m = 0; m < MR; ++m) acc[m][0] = E::madd(acc[m][0], E::load(x + m * K + k, left), wv);
    }
    const float b = bias ? static_cast<float>(bias[n]) : 0.f;
    for (int m = 0; m < MR; ++m) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
      y[m * N + n] = T(_mm512_reduce_add_ps(sum) + b);  // rounded once
    }
  }
}

// MR = 1..4 activation rows at a time, through E's registers.
template <class E>
struct Avx512 {
  using T = typename E::T;
  static void rows(const T* x, int64_t mr, const T* w, const T* bias, T* y, int64_t N, int64_t K, int64_t n0,
                   int64_t n1) {
    switch (mr) {
      case 1: return rows_avx512<E, 1>(x, w, bias, y, N, K, n0, n1);
      case 2: return rows_avx512<E, 2>(x, w, bias, y, N, K, n0, n1);
      case 3: return rows_avx512<E, 3>(x, w, bias, y, N, K, n0, n1);
      default: return rows_avx512<E, 4>(x, w, bias, y, N, K, n0, n1);
    }
  }
};

}  // namespace
