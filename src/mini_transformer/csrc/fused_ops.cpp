// mt_fused: the small per-token steps of a layer, each in one pass over its rows instead of several PyTorch
// ops (each op a dispatch and a trip through memory). fp32 rows, last dim contiguous. Reference for each:
// model/fused_ops.py (rms_norm_reference, silu_mul_reference), model/rope.py (apply_rope), torch.argmax.
//   rms_norm   y = w * (x / sqrt(mean(x^2) + eps))            over the last dim
//   rope       y = x * cos + rotate_half(x) * sin             rotate_half(x1, x2) = (-x2, x1)
//   silu_mul   y = silu(gate) * up,  silu(g) = g / (1 + e^-g)
//   argmax     the first index of each row's largest value    (the greedy token)
// Plain C++ only: independent lanes the compiler turns into vector code (csrc/README.md); no intrinsics.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "exp_generic.h"
#include "ops.h"

namespace {

constexpr int kLanes = 16;
constexpr int64_t kGrainElements = 1 << 14;  // a task gets at least this many elements: small batches stay serial

int64_t grain_rows(int64_t row_length) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_length)); }

// x (R, C) contiguous, w (C,) -> (R, C): the sum of squares in kLanes partial sums, then one scaling pass
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  const int64_t C = x.size(-1), R = x.numel() / C;
  auto y = at::empty_like(x);
  const float *xs = x.data_ptr<float>(), *ws = w.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, R, grain_rows(C), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xs + r * C;
      float lanes[kLanes] = {}, sum = 0.f;
      int64_t c = 0;
      for (; c + kLanes <= C; c += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] += xr[c + l] * xr[c + l];
      for (; c < C; ++c) sum += xr[c] * xr[c];
      for (int l = 0; l < kLanes; ++l) sum += lanes[l];
      const float inv = 1.f / std::sqrt(sum / C + static_cast<float>(eps));
      for (c = 0; c < C; ++c) ys[r * C + c] = ws[c] * (xr[c] * inv);  // as the reference rounds: (x * inv) * w
    }
  });
  return y;
}

// x (B, H, T, D) any strides but the last; cos, sin (B or 1, 1, T, D) contiguous -> (B, H, T, D) contiguous
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), half = D / 2;
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2), table_b = cos.size(0) == 1 ? 0 : T * D;
  auto y = at::empty({B, H, T, D}, x.options());
  const float *xs = x.data_ptr<float>(), *cs = cos.data_ptr<float>(), *ss = sin.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, B * H * T, grain_rows(D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (H * T), h = i / T % H, t = i % T;
      const float* xr = xs + b * sb + h * sh + t * st;
      const float *c = cs + b * table_b + t * D, *s = ss + b * table_b + t * D;
      float* yr = ys + i * D;
      for (int64_t d = 0; d < half; ++d) yr[d] = xr[d] * c[d] + (-xr[d + half]) * s[d];
      for (int64_t d = half; d < D; ++d) yr[d] = xr[d] * c[d] + xr[d - half] * s[d];
    }
  });
  return y;
}

// gate, up (..., F) contiguous -> silu(gate) * up; silu(g) = g * sigmoid(g), sigmoid from e = e^-|g| (no overflow)
at::Tensor silu_mul(at::Tensor gate, at::Tensor up) {
  auto y = at::empty_like(gate);
  const float *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, gate.numel(), kGrainElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float e = exp_generic(-std::fabs(g[i]));
      const float sigmoid = (g[i] >= 0.f ? 1.f : e) / (1.f + e);
      ys[i] = g[i] * sigmoid * u[i];
    }
  });
  return y;
}

// x (R, V) contiguous -> (R,) int64, in two passes over each row: its maximum in kLanes running maxima (vector
// code), then the first place that maximum occurs. (A NaN is passed over, unlike torch.argmax: logits are finite.)
at::Tensor argmax(at::Tensor x) {
  const int64_t V = x.size(-1), R = x.numel() / V;
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xs = x.data_ptr<float>();
  int64_t* os = out.data_ptr<int64_t>();
  at::parallel_for(0, R, grain_rows(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xs + r * V;
      float lanes[kLanes], top = -std::numeric_limits<float>::infinity();
      std::fill(lanes, lanes + kLanes, top);
      int64_t v = 0;
      for (; v + kLanes <= V; v += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], xr[v + l]);
      for (; v < V; ++v) top = std::max(top, xr[v]);
      for (int l = 0; l < kLanes; ++l) top = std::max(top, lanes[l]);
      const float* first = std::find(xr, xr + V, top);
      os[r] = first == xr + V ? 0 : first - xr;
    }
  });
  return out;
}

}  // namespace

DEFINE_OPS(LIBRARY_NAME(mt_fused), m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
}
IMPLEMENT_OPS(LIBRARY_NAME(mt_fused), CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax", &argmax);
}
