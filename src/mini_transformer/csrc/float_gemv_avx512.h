// The AVX-512 element types of float_gemv.cpp's SIMD loop: per type how many values a register holds, a masked
// load and acc += x * w; the fp32 accumulator (16 lanes) is shared. Included only where the compiler has
// AVX-512 F, BW and VL; bf16 takes vdpbf16ps where there is AVX512_BF16, else it is widened on load as fp16 is.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

// 16 fp32 sums in a register; 32 registers hold 4 accumulators for each of 4 activation rows. The activations
// are read as fp32 (X), 16 at a time, the lanes past n masked off.
struct Zmm {
  using Acc = __m512;
  using X = float;
  static __m512 loadx(const float* p, int n) {
    return n == 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
  }
  static constexpr int kAccumulators = 4;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float reduce(Acc a) { return _mm512_reduce_add_ps(a); }
};

struct F32 : Zmm {
  using T = float;
  using V = __m512;
  static constexpr int L = 16;
  static V load(const T* p, int n) { return loadx(p, n); }
  static __m512 madd(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};

// n <= 16 16-bit values, the rest of the 16 zero: what fp16 and (without AVX512_BF16) bf16 widen
static inline __m256i load_16(const void* p, int n) {
  return n == 16 ? _mm256_loadu_si256((const __m256i*)p) : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), p);
}

struct F16 : Zmm {  // widened to fp32 on load (vcvtph2ps), exact
  using T = c10::Half;
  using V = __m512;
  static constexpr int L = 16;
  static V load(const T* p, int n) { return _mm512_cvtph_ps(load_16(p, n)); }
  static __m512 madd(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};

struct I8 : Zmm {  // int8 weights, 16 per load, widened to fp32 (vpmovsxbd, vcvtdq2ps): exact
  using T = int8_t;
  using V = __m512;
  static constexpr int L = 16;
  static V load(const T* p, int n) {
    const __m128i b =
        n == L ? _mm_loadu_si128((const __m128i*)p) : _mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1u), p);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  static __m512 madd(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};

#if defined(__AVX512BF16__)
struct BF16 : Zmm {  // pairs of products added into 16 fp32 lanes by vdpbf16ps, so x stays bf16
  using T = c10::BFloat16;
  using X = T;
  using V = __m512bh;
  static constexpr int L = 32;
  static V load(const T* p, int n) {
    return (V)(n == L ? _mm512_loadu_si512((const void*)p) : _mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), p));
  }
  static V loadx(const X* p, int n) { return load(p, n); }
  static __m512 madd(__m512 acc, V x, V w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#else
struct BF16 : Zmm {  // without AVX512_BF16 (Skylake to Ice Lake): widened to fp32 on load, a bf16 being the top half
  using T = c10::BFloat16;  // of an fp32: zero-extend to 32 bits, shift left by 16; exact
  using V = __m512;
  static constexpr int L = 16;
  static V load(const T* p, int n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_16(p, n)), 16));
  }
  static __m512 madd(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};
#endif

}  // namespace
