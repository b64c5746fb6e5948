// The AVX2 element types of float_gemv.cpp's SIMD loop: 8 fp32 lanes per register, 16-bit and int8 weights
// widened as they load (fp16 by F16C's vcvtph2ps, bf16 by a 16-bit shift: a bf16 is the top half of an fp32),
// then one fused multiply-add; every product is exact in fp32, so bf16 needs no special instruction here. Included only
// where the compiler has AVX2, FMA and F16C (and not AVX-512, which float_gemv_avx512.h takes).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// 8 fp32 sums in a register; 16 registers: 3 accumulators for each of up to 4 activation rows, which leaves
// room for the weights and activations being loaded. The same 3 for any row count: a row's sum keeps one order
// whatever batch it is in. The activations are read as fp32 (X), the lanes past n masked off.
struct Ymm {
  using Acc = __m256;
  using X = float;
  static __m256 loadx(const float* p, int n) {
    if (n == 8) return _mm256_loadu_ps(p);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));  // lanes < n
  }
  static constexpr int kAccumulators = 3;
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  static float reduce(Acc a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // 8 -> 4
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                          // 4 -> 2
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));                        // 2 -> 1
  }
  static Acc madd(Acc acc, __m256 x, __m256 w) { return _mm256_fmadd_ps(x, w, acc); }
};

// n < 8 16-bit values, the rest of the 8 zero: AVX2 has no masked 16-bit load, so through a small buffer
static inline __m128i load_partial_16(const void* p, int n) {
  uint16_t part[8] = {};
  std::memcpy(part, p, n * sizeof(uint16_t));
  return _mm_loadu_si128((const __m128i*)part);
}

struct F32 : Ymm {
  using T = float;
  using V = __m256;
  static constexpr int L = 8;
  static V load(const T* p, int n) { return loadx(p, n); }
};

struct F16 : Ymm {
  using T = c10::Half;
  using V = __m256;
  static constexpr int L = 8;
  static V load(const T* p, int n) {
    return _mm256_cvtph_ps(n == L ? _mm_loadu_si128((const __m128i*)p) : load_partial_16(p, n));
  }
};

struct BF16 : Ymm {
  using T = c10::BFloat16;
  using V = __m256;
  static constexpr int L = 8;
  static V load(const T* p, int n) {
    const __m128i h = n == L ? _mm_loadu_si128((const __m128i*)p) : load_partial_16(p, n);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

struct I8 : Ymm {  // int8 weights, 8 per load, widened to fp32 (vpmovsxbd, vcvtdq2ps): exact
  using T = int8_t;
  using V = __m256;
  static constexpr int L = 8;
  static V load(const T* p, int n) {
    int64_t part = 0;  // n < 8 bytes through a buffer, the rest zero
    if (n < L) std::memcpy(&part, p, n);
    const __m128i b = _mm_loadl_epi64((const __m128i*)(n == L ? (const void*)p : (const void*)&part));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
};

}  // namespace
