// mt_float::gemv: y (M, N) = x (M, K) W (N, K)^T (+ bias), fp32 / bf16 / fp16, M <= 8, every sum in fp32 and
// rounded once to x's dtype. Reference: model/float_gemv.py::float_gemv_reference.
// mt_float::gemv_int8: the same loop over int8 weights, one scale per weight row: y = (x q^T) * scale (+ bias), x,
// y, scale and bias fp32. Reference: model/quantize.py::int8_rowwise.
// W is read front to back, one row after the other (one stream the hardware prefetcher follows; docs/08b §4).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "row_split.h"

// The SIMD path's element types (F32, F16, BF16, I8): AVX-512 where the compiler has it, else AVX2.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "float_gemv_avx512.h"
#define FLOAT_GEMV_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "float_gemv_avx2.h"
#define FLOAT_GEMV_SIMD 1
#endif

namespace {

// The type of y, the bias and x as the caller passes it: the weights' own for float weights, fp32 for int8.
template <typename T>
using Out = std::conditional_t<std::is_same_v<T, int8_t>, float, T>;

// The portable path: per activation row kLanes independent fp32 sums (lane l takes inputs l, l + kLanes, ...),
// which the compiler may keep in vector registers - a single running sum it may not reorder, so it would stay
// scalar. Each sum (times the row's scale, for int8) + bias rounded once.
template <typename T, int MR>
static void rows_generic(const Out<T>* x, const T* w, const float* scale, const Out<T>* bias, Out<T>* y, int64_t N,
                         int64_t K, int64_t n0, int64_t n1) {
  constexpr int kLanes = 16;
  for (int64_t n = n0; n < n1; ++n) {
    const T* row = w + n * K;
    float acc[MR][kLanes] = {};
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      float wv[kLanes];
      for (int l = 0; l < kLanes; ++l) wv[l] = static_cast<float>(row[k + l]);
      for (int m = 0; m < MR; ++m)
        for (int l = 0; l < kLanes; ++l) acc[m][l] += static_cast<float>(x[m * K + k + l]) * wv[l];
    }
    const float b = bias ? static_cast<float>(bias[n]) : 0.f, s = scale ? scale[n] : 1.f;
    for (int m = 0; m < MR; ++m) {
      float sum = 0.f;
      for (int64_t t = k; t < K; ++t) sum += static_cast<float>(x[m * K + t]) * static_cast<float>(row[t]);
      for (int l = 0; l < kLanes; ++l) sum += acc[m][l];
      y[m * N + n] = Out<T>(sum * s + b);  // rounded once
    }
  }
}

// f(std::integral_constant<int, MR>) for mr = 1..4 activation rows: the rows loops take MR as a template argument
template <class F>
static void with_rows(int64_t mr, const F& f) {
  switch (mr) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

template <typename Scalar>
struct Generic {
  using T = Scalar;
  using X = Out<T>;
  static void rows(const X* x, int64_t mr, const T* w, const float* scale, const Out<T>* bias, Out<T>* y, int64_t N,
                   int64_t K, int64_t n0, int64_t n1) {
    with_rows(mr, [&](auto MR) { rows_generic<T, MR>(x, w, scale, bias, y, N, K, n0, n1); });
  }
};

#ifdef FLOAT_GEMV_SIMD
constexpr int kPrefetchBytes = 2048;  // how far ahead of the loads the weight stream is asked for

// The SIMD path, for E one of the element types above. Weight rows [n0, n1) (w, stride K) against MR activation
// rows (x, stride K) -> y (MR, N), each sum (times the row's scale, for int8) + bias rounded once. A accumulators
// per activation row, so an add never waits for the one before it (A does not depend on MR: a row sums in one
// order in any batch); each register of w is loaded once and used MR times. x is of type E::X: fp32 where E
// widens the weights on load (a 16-bit x widened once per call, not once per weight row), else E::T (bf16 with
// AVX512_BF16, whose dot instruction takes bf16 pairs).
template <class E, int MR>
static void rows_simd(const typename E::X* x, const typename E::T* w, const float* scale,
                      const Out<typename E::T>* bias, Out<typename E::T>* y, int64_t N, int64_t K, int64_t n0,
                      int64_t n1) {
  using T = typename E::T;
  using Acc = typename E::Acc;
  constexpr int A = E::kAccumulators, L = E::L;
  for (int64_t n = n0; n < n1; ++n) {
    const T* row = w + n * K;
    Acc acc[MR][A];
    for (int m = 0; m < MR; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = E::zero();
    int64_t k = 0;
    for (; k + A * L <= K; k += A * L) {  // full steps of A registers
      // ask for the weight stream kPrefetchBytes ahead (past this row's end: the next row follows it): the
      // hardware prefetcher alone keeps too few lines in flight for one core to reach its share of the bandwidth
      for (int line = 0; line < A * L * (int)sizeof(T); line += 64)
        _mm_prefetch((const char*)(row + k) + kPrefetchBytes + line, _MM_HINT_T0);
      for (int a = 0; a < A; ++a) {
        const typename E::V wv = E::load(row + k + a * L, L);
        for (int m = 0; m < MR; ++m) acc[m][a] = E::madd(acc[m][a], E::loadx(x + m * K + k + a * L, L), wv);
      }
    }
    for (; k < K; k += L) {  // the rest, one register at a time, the last one masked
      const int left = (int)std::min<int64_t>(L, K - k);
      const typename E::V wv = E::load(row + k, left);
      for (int m = 0; m < MR; ++m) acc[m][0] = E::madd(acc[m][0], E::loadx(x + m * K + k, left), wv);
    }
    const float b = bias ? static_cast<float>(bias[n]) : 0.f, s = scale ? scale[n] : 1.f;
    for (int m = 0; m < MR; ++m) {
      Acc sum = acc[m][0];
      for (int a = 1; a < A; ++a) sum = E::add(sum, acc[m][a]);
      y[m * N + n] = Out<T>(E::reduce(sum) * s + b);  // rounded once
    }
  }
}

// MR = 1..4 activation rows at a time, through E's registers.
template <class E>
struct Simd {
  using T = typename E::T;
  using X = typename E::X;
  static void rows(const X* x, int64_t mr, const T* w, const float* scale, const Out<T>* bias, Out<T>* y, int64_t N,
                   int64_t K, int64_t n0, int64_t n1) {
    with_rows(mr, [&](auto MR) { rows_simd<E, MR>(x, w, scale, bias, y, N, K, n0, n1); });
  }
};
#endif

// y (M, N) = x (M, K) W (N, K)^T + bias for the weight rows [begin, end): 64 rows at a time (they stay in L2),
// each block against the rows of x 4 at a time, so for M > 4 the block is read from memory once. noinline:
// inlined into parallel_for's lambda the same loops run slower (docs/08b §4).
template <class D, typename Y = Out<typename D::T>>
__attribute__((noinline)) static void gemv_range(const typename D::X* x, const typename D::T* w, const float* scale,
                                                 const Y* bias, Y* y, int64_t M, int64_t N, int64_t K, int64_t begin,
                                                 int64_t end) {
  constexpr int64_t kBlock = 64;
  for (int64_t n0 = begin; n0 < end; n0 += kBlock)
    for (int64_t m = 0; m < M; m += 4)
      D::rows(x + m * K, std::min<int64_t>(4, M - m), w, scale, bias, y + m * N, N, K, n0,
              std::min(n0 + kBlock, end));
}

// Rows of W in one contiguous slice per thread (row_split.h); each row summed by one thread in one order.
template <class D, typename Y = Out<typename D::T>>
static void gemv_rows(const Y* x_in, const typename D::T* w, const float* scale, const Y* bias, Y* y, int64_t M,
                      int64_t N, int64_t K) {
  using X = typename D::X;
  std::vector<X> widened;  // x as the rows loop reads it, where that is another type: M x K values, once
  const X* x;
  if constexpr (std::is_same_v<X, Y>) {
    x = x_in;
  } else {
    widened.assign(x_in, x_in + M * K);
    x = widened.data();
  }
  parallel_rows(N, K * (int64_t)sizeof(typename D::T),
                [=](int64_t begin, int64_t end) { gemv_range<D>(x, w, scale, bias, y, M, N, K, begin, end); });
}

template <typename T>
static void gemv_typed(const Out<T>* x, const T* w, const float* scale, const Out<T>* bias, Out<T>* y, int64_t M,
                       int64_t N, int64_t K) {
#ifdef FLOAT_GEMV_SIMD
  if constexpr (std::is_same_v<T, float>) return gemv_rows<Simd<F32>>(x, w, scale, bias, y, M, N, K);
  if constexpr (std::is_same_v<T, c10::Half>) return gemv_rows<Simd<F16>>(x, w, scale, bias, y, M, N, K);
  if constexpr (std::is_same_v<T, int8_t>) return gemv_rows<Simd<I8>>(x, w, scale, bias, y, M, N, K);
  if constexpr (std::is_same_v<T, c10::BFloat16>) return gemv_rows<Simd<BF16>>(x, w, scale, bias, y, M, N, K);
#endif
  gemv_rows<Generic<T>>(x, w, scale, bias, y, M, N, K);
}

// x (M, K), weight (N, K), bias (N,) or None, one dtype (fp32, bf16, fp16) -> (M, N) of that dtype
at::Tensor float_gemv(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "mt_float::gemv: x (M, K), weight (N, K)");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(weight.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "mt_float::gemv: x and weight of one dtype: float32, bfloat16 or float16");
  x = x.contiguous(), weight = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->numel() == N, "mt_float::gemv: bias (N,) of x's dtype");
    b = bias->contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "mt_float::gemv", [&] {
    const scalar_t* bias_data = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    gemv_typed<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), nullptr, bias_data,
                         y.data_ptr<scalar_t>(), M, N, K);
  });
  return y;
}

// x (M, K) fp32, weight (N, K) int8, scales (N,) fp32, bias (N,) fp32 or None -> (M, N) fp32
at::Tensor int8_gemv(at::Tensor x, at::Tensor weight, at::Tensor scales, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "mt_float::gemv_int8: x (M, K), weight (N, K)");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kChar,
              "mt_float::gemv_int8: fp32 x, int8 weight");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N, "mt_float::gemv_int8: scales (N,) fp32");
  x = x.contiguous(), weight = weight.contiguous(), scales = scales.contiguous();
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "mt_float::gemv_int8: bias (N,) fp32");
    b = bias->contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  gemv_typed<int8_t>(x.data_ptr<float>(), weight.data_ptr<int8_t>(), scales.data_ptr<float>(),
                     b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, N, K);
  return y;
}

// whether weights of `dtype` (int8 for gemv_int8) run the SIMD path (else the generic one)
bool float_gemv_vectorized(c10::ScalarType dtype) {
#ifdef FLOAT_GEMV_SIMD
  if (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kChar) return true;
#endif
  return false;
}

}  // namespace

DEFINE_OPS(LIBRARY_NAME(mt_float), m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor weight, Tensor scales, Tensor? bias=None) -> Tensor");
  m.def("vectorized(ScalarType dtype) -> bool");
}
IMPLEMENT_OPS(LIBRARY_NAME(mt_float), CPU, m) {
  m.impl("gemv", &float_gemv);
  m.impl("gemv_int8", &int8_gemv);
}
IMPLEMENT_OPS(LIBRARY_NAME(mt_float), CompositeExplicitAutograd, m) {
  m.impl("vectorized", &float_gemv_vectorized);
}
