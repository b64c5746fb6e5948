// mt_float::gemv: y (M, N) = x (M, K) W (N, K)^T (+ bias), fp32 / bf16 / fp16, M <= 8, every sum in fp32 and
// rounded once to x's dtype. Reference: model/float_gemv.py::float_gemv_reference. W is read front to back,
// one row after the other (one stream the hardware prefetcher follows; docs/08b §4).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops.h"
#include "row_split.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "float_gemv_avx512.h"
#define FLOAT_GEMV_AVX512 1
#endif

namespace {

// The portable path: per activation row kLanes independent fp32 sums (lane l takes inputs l, l + kLanes, ...),
// which the compiler may keep in vector registers - a single running sum it may not reorder, so it would stay
// scalar. Each sum + bias rounded once.
template <typename T, int MR>
static void rows_generic(const T* x, const T* w, const T* bias, T* y, int64_t N, int64_t K, int64_t n0,
                         int64_t n1) {
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
    const float b = bias ? static_cast<float>(bias[n]) : 0.f;
    for (int m = 0; m < MR; ++m) {
      float sum = 0.f;
      for (int64_t t = k; t < K; ++t) sum += static_cast<float>(x[m * K + t]) * static_cast<float>(row[t]);
      for (int l = 0; l < kLanes; ++l) sum += acc[m][l];
      y[m * N + n] = T(sum + b);  // rounded once
    }
  }
}

template <typename Scalar>
struct Generic {
  using T = Scalar;
  static void rows(const T* x, int64_t mr, const T* w, const T* bias, T* y, int64_t N, int64_t K, int64_t n0,
                   int64_t n1) {
    switch (mr) {
      case 1: return rows_generic<T, 1>(x, w, bias, y, N, K, n0, n1);
      case 2: return rows_generic<T, 2>(x, w, bias, y, N, K, n0, n1);
      case 3: return rows_generic<T, 3>(x, w, bias, y, N, K, n0, n1);
      default: return rows_generic<T, 4>(x, w, bias, y, N, K, n0, n1);
    }
  }
};

// y (M, N) = x (M, K) W (N, K)^T + bias for the weight rows [begin, end): 64 rows at a time (they stay in L2),
// each block against the rows of x 4 at a time, so for M > 4 the block is read from memory once. noinline:
// inlined into parallel_for's lambda the same loops run slower (docs/08b §4).
template <class D>
__attribute__((noinline)) static void gemv_range(const typename D::T* x, const typename D::T* w,
                                                 const typename D::T* bias, typename D::T* y, int64_t M, int64_t N,
                                                 int64_t K, int64_t begin, int64_t end) {
  constexpr int64_t kBlock = 64;
  for (int64_t n0 = begin; n0 < end; n0 += kBlock)
    for (int64_t m = 0; m < M; m += 4)
      D::rows(x + m * K, std::min<int64_t>(4, M - m), w, bias, y + m * N, N, K, n0, std::min(n0 + kBlock, end));
}

// Rows of W in contiguous chunks over the threads (row_split.h); each row summed by one thread in one order.
template <class D>
static void gemv_rows(const typename D::T* x, const typename D::T* w, const typename D::T* bias, typename D::T* y,
                      int64_t M, int64_t N, int64_t K) {
  parallel_rows(N, K * (int64_t)sizeof(typename D::T),
                [=](int64_t begin, int64_t end) { gemv_range<D>(x, w, bias, y, M, N, K, begin, end); });
}

template <typename T>
static void gemv_typed(const T* x, const T* w, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
#ifdef FLOAT_GEMV_AVX512
  if constexpr (std::is_same_v<T, float>) return gemv_rows<Avx512<F32>>(x, w, bias, y, M, N, K);
  if constexpr (std::is_same_v<T, c10::Half>) return gemv_rows<Avx512<F16>>(x, w, bias, y, M, N, K);
#ifdef FLOAT_GEMV_AVX512_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) return gemv_rows<Avx512<BF16>>(x, w, bias, y, M, N, K);
#endif
#endif
  gemv_rows<Generic<T>>(x, w, bias, y, M, N, K);
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
    gemv_typed<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), bias_data, y.data_ptr<scalar_t>(), M, N,
                         K);
  });
  return y;
}

bool float_gemv_vectorized(c10::ScalarType dtype) {  // whether `dtype` runs the AVX-512 path (else the generic one)
#ifdef FLOAT_GEMV_AVX512
  if (dtype == at::kFloat || dtype == at::kHalf) return true;
#endif
#ifdef FLOAT_GEMV_AVX512_BF16
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

}  // namespace

DEFINE_OPS(LIBRARY_NAME(mt_float), m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("vectorized(ScalarType dtype) -> bool");
}
IMPLEMENT_OPS(LIBRARY_NAME(mt_float), CPU, m) {
  m.impl("gemv", &float_gemv);
}
IMPLEMENT_OPS(LIBRARY_NAME(mt_float), CompositeExplicitAutograd, m) {
  m.impl("vectorized", &float_gemv_vectorized);
}
