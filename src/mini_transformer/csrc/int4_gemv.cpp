// mt_gemv::int4: y (M, N) = x (M, K) times int4 weights (N, K/2 packed bytes, per-group scale and minimum),
// ggml's Q4_0 x Q8_0 idea: each activation row rounded to int8 per group, integer dot products with the 4-bit
// codes, one float multiply-add per group. Reference: model/int4_gemv.py::int4_gemv_reference (the arithmetic
// written out there). Byte j of a weight row holds inputs 2j (low nibble) and 2j+1 (high), so the activations
// are reordered instead (evens, then odds) and each packed byte is used where it lands.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "row_split.h"

namespace {

// The packed weights asked for this far ahead of the loads, into L2, and their scales a quarter as far (a row's
// scales are a quarter of its bytes at group 64): the hardware prefetchers alone keep too few lines in flight for
// the integer loop, which takes longer per byte than a float GEMV's, to reach its share of the bandwidth.
constexpr int kPrefetchBytes = 4096;

static inline void prefetch_ahead(const uint8_t* w, const float* sl) {
  __builtin_prefetch((const char*)w + kPrefetchBytes, 0, 2);  // GCC's and clang's; locality 2: L2 and up
  __builtin_prefetch((const char*)sl + kPrefetchBytes / 4, 0, 2);
}

}  // namespace

// The AVX2 loop also serves a VNNI build where the VNNI one cannot (K not a multiple of 128, groups of 64 x odd).
#if defined(__AVX2__) && defined(__FMA__)
#include "int4_gemv_avx2.h"
#define INT4_GEMV_AVX2 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "int4_gemv_avx512.h"
#define INT4_GEMV_VNNI 1
#endif

namespace {

// The loop that runs a call, picked once from the build and the shapes: the VNNI one steps 128 inputs, two groups
// of 64 (4 rows at a time) or within a group of 128k (a group of 192 would straddle steps); the AVX2 one steps 64
// inputs (groups of 64k, 4 rows at a time); the generic one takes any group.
enum class Loop { kVnni64, kVnni, kAvx2, kGeneric };

static Loop pick_loop([[maybe_unused]] int64_t K, [[maybe_unused]] int64_t group) {
#ifdef INT4_GEMV_VNNI
  if (K % 128 == 0 && group == 64) return Loop::kVnni64;
  if (K % 128 == 0 && group % 128 == 0) return Loop::kVnni;
#endif
#ifdef INT4_GEMV_AVX2
  if (group % 64 == 0) return Loop::kAvx2;
#endif
  return Loop::kGeneric;
}

// How many inputs the generic (and AVX2) codes are laid out in: 64 where the group is 64k, else 32.
static int64_t unit_of(int64_t group) { return group % 64 == 0 ? 64 : 32; }

// One activation row, quantized per group: dx (G,) the group scales, xsum (G,) each group's float sum,
// xq (K,) the int8 codes in the order the dot products read them. The generic loop reads `unit` (64 or 32)
// inputs at a time, packed as bytes of (even, odd) input pairs: so within a unit the codes go evens, then odds.
static void quantize_row_generic(const float* x, int64_t K, int64_t group, int64_t unit, int8_t* xq, float* dx,
                                 float* xsum) {
  for (int64_t g = 0; g < K / group; ++g) {
    float amax = 0.f, s = 0.f;
    for (int64_t k = g * group; k < (g + 1) * group; ++k) { amax = std::max(amax, std::fabs(x[k])); s += x[k]; }
    dx[g] = amax / 127.f;
    xsum[g] = s;
  }
  for (int64_t u = 0; u < K; u += unit) {
    const float d = dx[u / group];  // a unit lies inside one group
    for (int64_t j = 0; j < unit / 2; ++j) {
      xq[u + j] = d == 0.f ? 0 : (int8_t)std::nearbyint(x[u + 2 * j] / d);
      xq[u + unit / 2 + j] = d == 0.f ? 0 : (int8_t)std::nearbyint(x[u + 2 * j + 1] / d);
    }
  }
}

// Any group size: one weight row, plain loops (units of `unit` inputs); the integer sums are exact in any
// order, so the compiler may vectorise them freely. sl (G, 2): each group's scale, low.
static float row_dot_generic(const uint8_t* w, const float* sl, const int8_t* xq, const float* dx,
                             const float* xsum, int64_t G, int64_t group, int64_t unit) {
  float y = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    int32_t dot = 0;
    for (int64_t c = g * group; c < (g + 1) * group; c += unit)
      for (int64_t j = 0; j < unit / 2; ++j)
        dot += (int32_t)(w[c / 2 + j] & 15) * xq[c + j] + (int32_t)(w[c / 2 + j] >> 4) * xq[c + unit / 2 + j];
    y += sl[2 * g] * dx[g] * (float)dot + sl[2 * g + 1] * xsum[g];
  }
  return y;
}

// The activations of one call, quantized once for every weight row: xq (M, K) codes, dx and xsum (M, G); for
// the VNNI loop at group 64 also dxv (M, K/8), dx spread over the lanes where its FMA reads them, and xsl
// (M, 2G), 0 xsum0 0 xsum1 ..., laid out as a weight row's (G, 2) scales and minimums.
struct Activations {
  std::vector<int8_t> xq;
  std::vector<float> dx, xsum, dxv, xsl;
};

static Activations quantize_activations(const float* x, int64_t M, int64_t K, int64_t group, Loop loop) {
  const int64_t G = K / group;
  const bool vnni64 = loop == Loop::kVnni64;
  Activations a{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G),
                std::vector<float>(vnni64 ? M * K / 8 : 0), std::vector<float>(vnni64 ? M * 2 * G : 0)};
  for (int64_t m = 0; m < M; ++m) {
#ifdef INT4_GEMV_VNNI
    if (vnni64 || loop == Loop::kVnni) {
      quantize_row_vnni(x + m * K, K, group, a.xq.data() + m * K, a.dx.data() + m * G, a.xsum.data() + m * G);
      for (int64_t g = 0; vnni64 && g < G; ++g) {
        for (int64_t i = 0; i < 8; ++i) a.dxv[m * K / 8 + g * 8 + i] = a.dx[m * G + g];
        a.xsl[m * 2 * G + 2 * g + 1] = a.xsum[m * G + g];
      }
      continue;
    }
#endif
    quantize_row_generic(x + m * K, K, group, unit_of(group), a.xq.data() + m * K, a.dx.data() + m * G,
                         a.xsum.data() + m * G);
  }
  return a;
}

// The weight rows [begin, end) against every activation row into y (M, N): 4 rows at a time through the SIMD
// loops that can (each load of the activations serves 4 rows, and a block of rows, a few KB, is read from memory
// once for all M), the rest one row at a time.
static void int4_rows(const Activations& a, const uint8_t* w, const float* sl, float* y, int64_t M, int64_t N,
                      int64_t K, int64_t group, Loop loop, int64_t begin, int64_t end) {
  const int64_t G = K / group;
  [[maybe_unused]] const auto in_blocks = [&](const auto& rows) {  // rows(n, R): rows [n, n + R), R = 4 then 1
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) rows(n, std::integral_constant<int, 4>{});
    for (; n < end; ++n) rows(n, std::integral_constant<int, 1>{});
  };
  switch (loop) {
#ifdef INT4_GEMV_VNNI
    case Loop::kVnni64:
      return in_blocks([&](int64_t n, auto R) {
        for (int64_t m = 0; m < M; ++m)
          rows_dot_vnni64<R>(w + n * K / 2, sl + n * 2 * G, a.xq.data() + m * K, a.dxv.data() + m * K / 8,
                             a.xsl.data() + m * 2 * G, K, y + m * N + n);
      });
    case Loop::kVnni:
      for (int64_t n = begin; n < end; ++n)
        for (int64_t m = 0; m < M; ++m)
          y[m * N + n] = row_dot_vnni(w + n * K / 2, sl + n * 2 * G, a.xq.data() + m * K, a.dx.data() + m * G,
                                      a.xsum.data() + m * G, G, group);
      return;
#endif
#ifdef INT4_GEMV_AVX2
    case Loop::kAvx2:
      return in_blocks([&](int64_t n, auto R) {
        for (int64_t m = 0; m < M; ++m)
          rows_dot_avx2<R>(w + n * K / 2, sl + n * 2 * G, a.xq.data() + m * K, a.dx.data() + m * G,
                           a.xsum.data() + m * G, G, group, y + m * N + n);
      });
#endif
    default:
      for (int64_t n = begin; n < end; ++n)
        for (int64_t m = 0; m < M; ++m)
          y[m * N + n] = row_dot_generic(w + n * K / 2, sl + n * 2 * G, a.xq.data() + m * K, a.dx.data() + m * G,
                                         a.xsum.data() + m * G, G, group, unit_of(group));
  }
}

// x (M, K) float32, packed (N, K/2) uint8, scale_low (N, G, 2) float32 -> y (M, N) float32
at::Tensor int4_gemv(at::Tensor x, at::Tensor packed, at::Tensor scale_low, int64_t group) {
  TORCH_CHECK(x.dtype() == at::kFloat && packed.dtype() == at::kByte && scale_low.dtype() == at::kFloat,
              "mt_gemv::int4: float32 x, uint8 packed, float32 scale_low");
  TORCH_CHECK(x.dim() == 2 && group > 0 && x.size(1) % group == 0 && (group == 32 || group % 64 == 0),
              "mt_gemv::int4: x (M, K), K a multiple of the group size, groups of 32 or 64k");
  x = x.contiguous(), packed = packed.contiguous(), scale_low = scale_low.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), G = K / group;
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) == K / 2 && scale_low.numel() == N * G * 2,
              "mt_gemv::int4: packed (N, K/2), scale_low (N, K/group, 2)");
  const Loop loop = pick_loop(K, group);
  const Activations a = quantize_activations(x.data_ptr<float>(), M, K, group, loop);
  auto y = at::empty({M, N}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* sl = scale_low.data_ptr<float>();
  float* out = y.data_ptr<float>();
  // Weight rows (packed bytes and their scales) split over the threads (row_split.h); each output summed by one
  // thread in one order, so any thread count gives the same bits.
  parallel_rows(N, K / 2 + 2 * G * (int64_t)sizeof(float), [&](int64_t begin, int64_t end) {
    int4_rows(a, w, sl, out, M, N, K, group, loop, begin, end);
  });
  return y;
}

bool int4_gemv_vectorized() {  // whether this build has a SIMD path, VNNI or AVX2 (else the generic loop)
#if defined(INT4_GEMV_VNNI) || defined(INT4_GEMV_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace

DEFINE_OPS(LIBRARY_NAME(mt_gemv), m) {
  m.def("int4(Tensor x, Tensor packed, Tensor scale_low, int group_size) -> Tensor");
  m.def("vectorized() -> bool");
}
IMPLEMENT_OPS(LIBRARY_NAME(mt_gemv), CPU, m) {
  m.impl("int4", &int4_gemv);
}
IMPLEMENT_OPS(LIBRARY_NAME(mt_gemv), CompositeExplicitAutograd, m) {
  m.impl("vectorized", &int4_gemv_vectorized);
}
