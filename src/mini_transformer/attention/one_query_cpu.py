"""One query row against a contiguous K/V cache on the CPU: the compiled batch-1 decode step's attention.

inference/static_cache.py keeps K and V as fixed (B, Hkv, max_len, D) slabs and attends over ALL max_len
slots with a mask (slots not yet written are masked), so the step has one shape. `_one_query_attention`
there is the readable reference (scores, softmax, weighted sum of V as reductions inductor fuses); it reads
every slot of the slab, written or not. This kernel walks only the keys the mask lets through, with
paged_cpu.py's online softmax (TILE_SOURCE: the same tile loop, AVX-512 dots and exp, fp32 arithmetic for
fp32/bf16/fp16): for each (b, kv head), its G = H/Hkv query heads together, the unmasked keys are
gathered kTile at a time by index (a mask that is -inf, or False, means the K and V rows are never read)
and pass through attend_tile; out = acc / l and logsumexp = m + log l, what aten's CPU flash attention
returns. A row with no key left gets out 0 and logsumexp -inf (the reference would give NaN; sdpa_attention
never passes such a row). One task per (b, kv head), at::parallel_for.

Registered as `mt_one_query::attend` (with a fake for torch.compile), built on first use by `_native.build`;
`kernel_available()` is False where it cannot be built or MT_NATIVE_KERNELS=0: the reference runs.
"""

from __future__ import annotations

from functools import cache

import torch

from .._native import build
from .paged_cpu import KERNEL_DTYPES, TILE_SOURCE

__all__ = ["KERNEL_DTYPES", "kernel_available", "one_query_kernel"]

_SOURCE = TILE_SOURCE + r"""
// The contiguous kernel (the static cache's compiled decode step): one task per (b, kv head) with its G query
// heads; a key whose additive mask is -inf is never read, the others go through attend_tile kTile at a time.
template <typename T>
static void one_query_all(const T* q, const T* k, const T* v, const float* mask, int64_t mask_stride, float scale,
                          T* out, float* lse, int64_t B, int64_t H, int64_t Hkv, int64_t Tk, int64_t D) {
  constexpr int64_t kTile = 64;
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores(G * kTile), bias(kTile), m(G), l(G);
    std::vector<int64_t> rows(kTile);
    for (int64_t task = begin; task < end; ++task) {  // task = b * Hkv + kv head; its query heads task*G ...
      const int64_t h0 = task * G;
      const T* k_head = k + task * Tk * D;  // (Tk, D)
      const T* v_head = v + task * Tk * D;
      const float* mask_row = mask ? mask + task / Hkv * mask_stride : nullptr;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(q[h0 * D + i]) * scale;
      std::fill(m.begin(), m.end(), kNone);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      auto flush = [&](int64_t n) {
        attend_tile(qf.data(), k_head, v_head, rows.data(), mask ? bias.data() : nullptr, n, G, G, D, m.data(),
                    l.data(), acc.data(), scores.data(), kTile);
      };
      int64_t n = 0;
      for (int64_t t = 0; t < Tk; ++t) {
        const float add = mask_row ? mask_row[t] : 0.f;
        if (add == kNone) continue;  // masked: skipped, its K and V rows never read
        rows[n] = t * D;
        bias[n] = add;
        if (++n == kTile) flush(n), n = 0;
      }
      if (n) flush(n);
      for (int64_t i = 0; i < G; ++i) {  // a row with no key left: out 0, logsumexp -inf (never NaN)
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        for (int64_t d = 0; d < D; ++d) out[(h0 + i) * D + d] = static_cast<T>(acc[i * D + d] * inv);
        lse[h0 + i] = l[i] > 0.f ? m[i] + std::log(l[i]) : kNone;
      }
    }
  });
}

// q (B, H, 1, D); key, value (B, Hkv, Tk, D); attn_mask None or (B or 1, 1, 1, Tk), bool (True = may attend)
// or additive -> out (B, H, 1, D) in q's dtype, logsumexp (B, H, 1) fp32: what aten's CPU flash attention returns
std::tuple<torch::Tensor, torch::Tensor> attend(torch::Tensor q, torch::Tensor key, torch::Tensor value,
                                                   std::optional<torch::Tensor> attn_mask, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = key.size(1), Tk = key.size(2);
  TORCH_CHECK(q.size(2) == 1 && H % Hkv == 0, "mt_one_query::attend: one query row, H a multiple of Hkv");
  TORCH_CHECK(q.dtype() == key.dtype() && value.dtype() == key.dtype(), "mt_one_query::attend: one dtype");
  auto qc = q.contiguous(), kc = key.contiguous(), vc = value.contiguous();
  torch::Tensor mask;  // (B or 1, Tk) fp32, additive
  if (attn_mask) {
    const auto& am = *attn_mask;
    TORCH_CHECK(am.dim() == 4 && am.size(1) == 1 && am.size(2) == 1 && am.size(3) == Tk &&
                (am.size(0) == 1 || am.size(0) == B), "mt_one_query::attend: a (B or 1, 1, 1, Tk) mask");
    mask = am.dtype() == torch::kBool
               ? torch::zeros(am.sizes(), q.options().dtype(torch::kFloat32)).masked_fill_(am.logical_not(), -INFINITY)
               : am.to(torch::kFloat32);
    mask = mask.reshape({am.size(0), Tk}).contiguous();
  }
  auto out = torch::empty({B, H, 1, D}, q.options());
  auto lse = torch::empty({B, H, 1}, q.options().dtype(torch::kFloat32));
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const float* mask_data = mask.defined() ? mask.data_ptr<float>() : nullptr;
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

TORCH_LIBRARY(mt_one_query, m) {
  m.def("attend(Tensor q, Tensor key, Tensor value, Tensor? attn_mask, float scale) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(mt_one_query, CPU, m) {
  m.impl("attend", &attend);
}
"""


@cache
def kernel_available() -> bool:
    """Build and load the C++ kernel (first call in a process: ~30 s, then cached on disk); False where
    it cannot be built or MT_NATIVE_KERNELS=0 asks for the PyTorch reference."""
    return build("mt_one_query", _SOURCE, "one-query attention", fakes={"mt_one_query::attend": _attend_shape})


def _attend_shape(q, key, value, attn_mask, scale):
    B, H, _, D = q.shape
    return q.new_empty((B, H, 1, D)), q.new_empty((B, H, 1), dtype=torch.float32)


def one_query_kernel(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row against contiguous keys: q (B, H, 1, D), key/value (B, Hkv, Tk, D), attn_mask None or
    (B or 1, 1, 1, Tk), bool (True = may attend) or additive (-inf = may not) -> (out (B, H, 1, D),
    logsumexp (B, H, 1) fp32). kernel_available() must be True; q, key, value in one of KERNEL_DTYPES."""
    return torch.ops.mt_one_query.attend(q, key, value, attn_mask, scale)
