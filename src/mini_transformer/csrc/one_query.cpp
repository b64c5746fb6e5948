// mt_one_query::attend: one query row against a contiguous K/V slab (the static cache's compiled decode step).
// Only the keys the mask lets through are read, kTile at a time, through attention_tile.h's online softmax.
// Reference: inference/cpu_decode.py::_one_query_attention (what inductor runs when this kernel is off).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention_tile.h"
#include "ops.h"

namespace {

constexpr int64_t kTile = 64;
constexpr float kNone = -std::numeric_limits<float>::infinity();

// A row of the mask as the caller gave it: bool (True = may attend) or additive fp32; none = every key.
struct MaskRow {
  const bool* keep = nullptr;
  const float* add = nullptr;
  float operator[](int64_t t) const { return keep ? (keep[t] ? 0.f : kNone) : add ? add[t] : 0.f; }
  MaskRow shifted(int64_t offset) const { return {keep ? keep + offset : nullptr, add ? add + offset : nullptr}; }
};

// One task: kv head `task` (= b * Hkv + kv head) with its G query heads h0 ... h0 + G - 1. A key the mask shuts
// out (False, or -inf) is skipped (its K and V rows never read); the others go through attend_tile kTile at a time.
// A row with no key left gets out 0 and logsumexp -inf, never NaN.
struct Scratch {  // one thread's buffers, reused by its tasks
  explicit Scratch(int64_t G, int64_t D)
      : qf(G * D), acc(G * D), scores(G * kTile), bias(kTile), m(G), l(G), rows(kTile) {}
  std::vector<float> qf, acc, scores, bias, m, l;
  std::vector<int64_t> rows;
};

// Every line of key t's K and V rows, asked for as the tile is gathered: a layer's cache was last read a whole
// step ago, so it comes from memory, in runs of rows too short for the hardware prefetchers to ramp up on.
// (Asked for one tile ahead instead, they arrived no sooner.) __builtin_prefetch is GCC's and clang's.
template <typename T>
static inline void prefetch_row(const T* k_row, const T* v_row, int64_t D) {
  for (int64_t b = 0; b < D * (int64_t)sizeof(T); b += 64) {
    __builtin_prefetch((const char*)k_row + b);
    __builtin_prefetch((const char*)v_row + b);
  }
}

template <typename T>
static void attend_task(const T* q, const T* k, const T* v, MaskRow mask_row, float scale, T* out, float* lse,
                        int64_t task, int64_t G, int64_t Tk, int64_t D, Scratch& s) {
  auto &qf = s.qf, &acc = s.acc, &scores = s.scores, &bias = s.bias, &m = s.m, &l = s.l;
  auto& rows = s.rows;
  std::fill(m.begin(), m.end(), kNone);
  std::fill(l.begin(), l.end(), 0.f);
  std::fill(acc.begin(), acc.end(), 0.f);
  const int64_t h0 = task * G;
  const T* k_head = k + task * Tk * D;  // (Tk, D)
  const T* v_head = v + task * Tk * D;
  for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(q[h0 * D + i]) * scale;
  auto flush = [&](int64_t n) {
    attend_tile(qf.data(), k_head, v_head, rows.data(), mask_row.add ? bias.data() : nullptr, n, G, G, D, m.data(),
                l.data(), acc.data(), scores.data(), kTile);
  };
  int64_t n = 0;
  for (int64_t t = 0; t < Tk; ++t) {
    const float add = mask_row[t];
    if (add == kNone) continue;
    rows[n] = t * D;
    bias[n] = add;
    prefetch_row(k_head + t * D, v_head + t * D, D);
    if (++n == kTile) flush(n), n = 0;
  }
  if (n) flush(n);
  for (int64_t i = 0; i < G; ++i) {
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[(h0 + i) * D + d] = static_cast<T>(acc[i * D + d] * inv);
    lse[h0 + i] = l[i] > 0.f ? m[i] + std::log(l[i]) : kNone;
  }
}

// One task per (b, kv head), over threads: at batch 1 the kv heads alone fill them. Each task's heads are
// walked in one order whatever the split, so any thread count gives the same bits.
template <typename T>
static void one_query_all(const T* q, const T* k, const T* v, MaskRow mask, int64_t mask_stride, float scale,
                          T* out, float* lse, int64_t B, int64_t H, int64_t Hkv, int64_t Tk, int64_t D) {
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(G, D);
    for (int64_t task = begin; task < end; ++task)  // the mask row of this task's batch row
      attend_task(q, k, v, mask.shifted(task / Hkv * mask_stride), scale, out, lse, task, G, Tk, D, scratch);
  });
}

// attn_mask (B or 1, 1, 1, Tk), bool (True = may attend) or additive -> (B or 1, Tk), bool as it is (read in
// place: no fp32 copy per call), additive as fp32
at::Tensor mask_rows(const at::Tensor& am, int64_t B, int64_t Tk) {
  TORCH_CHECK(am.dim() == 4 && am.size(1) == 1 && am.size(2) == 1 && am.size(3) == Tk &&
              (am.size(0) == 1 || am.size(0) == B), "mt_one_query::attend: a (B or 1, 1, 1, Tk) mask");
  const auto mask = am.dtype() == at::kBool ? am : am.to(at::kFloat);
  return mask.reshape({am.size(0), Tk}).contiguous();
}

// q (B, H, 1, D); key, value (B, Hkv, Tk, D); attn_mask None or (B or 1, 1, 1, Tk), bool (True = may attend)
// or additive -> out (B, H, 1, D) in q's dtype, logsumexp (B, H, 1) fp32: what aten's CPU flash attention returns
std::tuple<at::Tensor, at::Tensor> one_query_attend(at::Tensor q, at::Tensor key, at::Tensor value,
                                                          std::optional<at::Tensor> attn_mask, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = key.size(1), Tk = key.size(2);
  TORCH_CHECK(q.size(2) == 1 && H % Hkv == 0, "mt_one_query::attend: one query row, H a multiple of Hkv");
  TORCH_CHECK(q.dtype() == key.dtype() && value.dtype() == key.dtype(), "mt_one_query::attend: one dtype");
  auto qc = q.contiguous(), kc = key.contiguous(), vc = value.contiguous();
  const at::Tensor mask = attn_mask ? mask_rows(*attn_mask, B, Tk) : at::Tensor();
  auto out = at::empty({B, H, 1, D}, q.options());
  auto lse = at::empty({B, H, 1}, q.options().dtype(at::kFloat));
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    MaskRow mask_data;
    if (mask.defined() && mask.dtype() == at::kBool) mask_data.keep = mask.data_ptr<bool>();
    if (mask.defined() && mask.dtype() == at::kFloat) mask_data.add = mask.data_ptr<float>();
    const int64_t mask_stride = mask.defined() && mask.size(0) == B ? Tk : 0;  // 0: one row for the batch
    one_query_all<T>(qc.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), mask_data, mask_stride, (float)scale,
                     out.data_ptr<T>(), lse.data_ptr<float>(), B, H, Hkv, Tk, D);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run((float*)nullptr); break;
    case at::kBFloat16: run((at::BFloat16*)nullptr); break;
    case at::kHalf: run((at::Half*)nullptr); break;
    default: TORCH_CHECK(false, "mt_one_query::attend: float32, bfloat16 or float16");
  }
  return {out, lse};
}

}  // namespace

DEFINE_OPS(LIBRARY_NAME(mt_one_query), m) {
  m.def("attend(Tensor q, Tensor key, Tensor value, Tensor? attn_mask, float scale) -> (Tensor, Tensor)");
  m.def("vectorized() -> bool");
}
IMPLEMENT_OPS(LIBRARY_NAME(mt_one_query), CPU, m) {
  m.impl("attend", &one_query_attend);
}
IMPLEMENT_OPS(LIBRARY_NAME(mt_one_query), CompositeExplicitAutograd, m) {
  m.impl("vectorized", &attention_tile_vectorized);
}
