"""Paged decode attention on the CPU as a hand-written C++ loop: each sequence's pages, one online softmax.

`paged.py::paged_decode_attention` is the readable reference: every (sequence, block, offset) at once,
a softmax over all keys. This kernel computes the same numbers the way FlashAttention (stage 4, docs/04)
walks tiles, with a block of the pool as the tile. For one sequence s and one kv head, with its G = H/Hkv
query heads q_g (pre-scaled by 1/sqrt(D)), it keeps per query head a running max m, a running sum l and
an accumulator acc (D floats), and for each block j of its block table (the keys K_j, values V_j of that
block, only the first context_len positions):

    x    = q_g . K_j^T                        the block's scores            (n,)
    m'   = max(m, max x)
    acc  = acc * exp(m - m') + sum_t exp(x_t - m') V_j[t]
    l    = l   * exp(m - m') + sum_t exp(x_t - m')
    m    = m'
    out_g = acc / l                            after the last block

Nothing is gathered or padded: the block table says where each block lies, and keys past context_len are
never read. The G query heads of a kv head go together, so each K/V row comes from memory once for all
of them. Dot products and the accumulate run 16 floats at a time with AVX-512 where the compiler has it
(a plain loop does the rest, and everything without AVX-512); 16-bit pools are widened to fp32 as they
load, so bf16/fp16 compute in fp32 like the reference. One task per (sequence, kv head), at::parallel_for.

Registered as the operator `mt_paged::decode` (with a fake for torch.compile); built on first use by
`_native.build`. `decode_kernel_available()` is False where it cannot be built: callers use the reference.
Its tile loop (TILE_SOURCE) also serves one_query_cpu.py, the static cache's kernel.
"""

from __future__ import annotations

from functools import cache

import torch

from .._native import build

__all__ = ["KERNEL_DTYPES", "TILE_SOURCE", "decode_kernel_available", "paged_decode_kernel"]

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64 keeps the PyTorch reference

# What both CPU kernels share (this one and one_query_cpu.py's): loads, exp, dot, the online softmax step
# and attend_tile, one tile of keys through it.
TILE_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#define MT_AVX512 1
// 16 pool elements widened to 16 fp32 lanes
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {  // bf16 is the top half of an fp32
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// e^x in 16 lanes: e^x = 2^k e^r with k = round(x / ln 2) and r = x - k ln 2 (|r| <= ln 2 / 2, ln 2 in two
// parts so r is exact); e^r by its Taylor series to degree 7 (error < 1e-8, below fp32's), 2^k by scalef.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // e^-104 is 0 in fp32 already
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);  // Horner: 1 + r + r^2/2! + ... + r^7/7!
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, k);
}
#endif

// q . k over D, q already fp32
template <typename T>
static inline float dot(const float* q, const T* k, int64_t D) {
  int64_t d = 0;
  float sum = 0.f;
#ifdef MT_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; d < D; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

// acc (D) += sum_t p[t] * v_t over n rows, v_t = v_base + rows[t] + offset. 64 floats of acc at a time stay in
// registers for all n rows (written back once, not once per row: the store-then-load of acc per row was the
// loop's critical path).
template <typename T>
static inline void weighted_sum(float* acc, const float* p, const T* v_base, const int64_t* rows, int64_t offset,
                                int64_t n, int64_t D) {
  int64_t d = 0;
#ifdef MT_AVX512
  for (; d + 64 <= D; d += 64) {
    __m512 a0 = _mm512_loadu_ps(acc + d), a1 = _mm512_loadu_ps(acc + d + 16), a2 = _mm512_loadu_ps(acc + d + 32),
           a3 = _mm512_loadu_ps(acc + d + 48);
    for (int64_t t = 0; t < n; ++t) {
      const T* v = v_base + rows[t] + offset + d;
      const __m512 pp = _mm512_set1_ps(p[t]);
      a0 = _mm512_fmadd_ps(pp, load16(v), a0);
      a1 = _mm512_fmadd_ps(pp, load16(v + 16), a1);
      a2 = _mm512_fmadd_ps(pp, load16(v + 32), a2);
      a3 = _mm512_fmadd_ps(pp, load16(v + 48), a3);
    }
    _mm512_storeu_ps(acc + d, a0), _mm512_storeu_ps(acc + d + 16, a1);
    _mm512_storeu_ps(acc + d + 32, a2), _mm512_storeu_ps(acc + d + 48, a3);
  }
  for (; d + 16 <= D; d += 16) {
    __m512 a = _mm512_loadu_ps(acc + d);
    for (int64_t t = 0; t < n; ++t) a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), load16(v_base + rows[t] + offset + d), a);
    _mm512_storeu_ps(acc + d, a);
  }
#endif
  for (; d < D; ++d)
    for (int64_t t = 0; t < n; ++t) acc[d] += p[t] * static_cast<float>(v_base[rows[t] + offset + d]);
}

// The online softmax's step for one query head and one block of scores x (n,): x becomes exp(x - m'),
// the running max m becomes m', the running sum l takes the block's weights; returns exp(m - m'), the factor
// by which everything accumulated before this block must shrink.
static inline float online_softmax_step(float* x, int64_t n, float& m, float& l) {
  const float new_m = std::max(m, *std::max_element(x, x + n));
  float sum = 0.f;
  int64_t t = 0;
#ifdef MT_AVX512
  for (; t < n; t += 16) {  // 16 scores at a time, the lanes past n masked off
    const __mmask16 live = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
    const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, x + t), _mm512_set1_ps(new_m)));
    _mm512_mask_storeu_ps(x + t, live, p);
    sum += _mm512_mask_reduce_add_ps(live, p);
  }
#endif
  for (; t < n; ++t) {
    x[t] = std::exp(x[t] - new_m);
    sum += x[t];
  }
  const float rescale = std::exp(m - new_m);  // 0 for the first block (m = -inf)
  l = l * rescale + sum;
  m = new_m;
  return rescale;
}

// One tile of n keys through the online softmax, for `heads` query heads q (heads, D) fp32 pre-scaled, each
// with its state m, l, acc (D). Key t's K row starts at k_base + rows[t] and its V row at v_base + rows[t];
// query head i reads the part (i / group) * D of them; bias (n,) is added to the scores where not null.
// Both kernels walk their keys tile by tile through this: the paged one a block, the contiguous one a run
// of unmasked keys.
template <typename T>
static void attend_tile(const float* q, const T* k_base, const T* v_base, const int64_t* rows, const float* bias,
                        int64_t n, int64_t heads, int64_t group, int64_t D, float* m, float* l, float* acc,
                        float* scores, int64_t tile) {
  for (int64_t t = 0; t < n; ++t) {  // scores (heads, n): each key row read once for all its query heads
    const T* k = k_base + rows[t];
    const float b = bias ? bias[t] : 0.f;
    for (int64_t i = 0; i < heads; ++i) scores[i * tile + t] = dot(q + i * D, k + (i / group) * D, D) + b;
  }
  for (int64_t i = 0; i < heads; ++i) {  // scores -> weights; shrink what came before if the max grew
    const float rescale = online_softmax_step(scores + i * tile, n, m[i], l[i]);
    if (rescale != 1.f)
      for (int64_t d = 0; d < D; ++d) acc[i * D + d] *= rescale;
  }
  for (int64_t i = 0; i < heads; ++i)  // acc += weights @ V (the tile's V rows stay in L1 across the heads)
    weighted_sum(acc + i * D, scores + i * tile, v_base, rows, (i / group) * D, n, D);
}

"""

_SOURCE = TILE_SOURCE + r"""
// One task: `heads` query heads of one sequence, q (heads, D) fp32 pre-scaled; query head i reads kv head
// i / group of each pool row. Walk the sequence's blocks with the online softmax, write out (heads, D).
template <typename T>
static void attend_one(const float* q, const T* k_pool, const T* v_pool, const int64_t* table, int64_t n_keys,
                       int64_t block_size, int64_t row_stride, int64_t heads, int64_t group, int64_t D,
                       float* acc, float* scores, int64_t* rows, T* out) {
  const int64_t row_bytes = heads / group * D * sizeof(T);  // the part of a pool row this task reads
  std::vector<float> m(heads, -std::numeric_limits<float>::infinity()), l(heads, 0.f);
  std::fill(acc, acc + heads * D, 0.f);
  for (int64_t start = 0, j = 0; start < n_keys; start += block_size, ++j) {
    const int64_t n = std::min(block_size, n_keys - start);  // keys of this block that exist
    const int64_t first_slot = table[j] * block_size;
    if (start + block_size < n_keys) {  // ask for the next block now: it lies anywhere, no prefetcher guesses it
      const int64_t next = table[j + 1] * block_size;
      for (int64_t t = 0; t < block_size; ++t)
        for (int64_t byte = 0; byte < row_bytes; byte += 64) {
          __builtin_prefetch((const char*)(k_pool + (next + t) * row_stride) + byte);
          __builtin_prefetch((const char*)(v_pool + (next + t) * row_stride) + byte);
        }
    }
    for (int64_t t = 0; t < n; ++t) rows[t] = (first_slot + t) * row_stride;
    attend_tile(q, k_pool, v_pool, rows, (const float*)nullptr, n, heads, group, D, m.data(), l.data(), acc, scores,
                block_size);
  }
  for (int64_t i = 0; i < heads; ++i)
    for (int64_t d = 0; d < D; ++d) out[i * D + d] = static_cast<T>(acc[i * D + d] / l[i]);
}

template <typename T>
static void decode_all(const float* q, const T* k_pool, const T* v_pool, const int64_t* tables, const int64_t* lens,
                       T* out, int64_t S, int64_t H, int64_t Hkv, int64_t D, int64_t B, int64_t block_size) {
  const int64_t G = H / Hkv;  // query heads per kv head
  // one task per sequence, all its heads: a pool row holds every kv head of a token side by side, so the
  // task reads whole rows (measured: bf16 pools 0.86 vs 1.18 ms a layer with a task per kv head)
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(H * D), scores(H * block_size);  // scratch, reused by this thread's tasks
    std::vector<int64_t> rows(block_size);
    for (int64_t s = begin; s < end; ++s)
      attend_one(q + s * H * D, k_pool, v_pool, tables + s * B, lens[s], block_size, Hkv * D, H, G, D,
                 acc.data(), scores.data(), rows.data(), out + s * H * D);
  });
}

// q (S, H, D); k_cache, v_cache (num_slots, Hkv, D); block_tables (S, B) int64; context_lens (S,) int64
// -> (S, H, D) in the pool's dtype (float32, bfloat16 or float16)
torch::Tensor decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                     torch::Tensor context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "mt_paged::decode: contiguous pools");
  TORCH_CHECK(q.dtype() == k_cache.dtype() && v_cache.dtype() == k_cache.dtype(), "mt_paged::decode: one dtype");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && context_lens.dtype() == torch::kInt64,
              "mt_paged::decode: int64 block_tables and context_lens");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  auto qf = (q.to(torch::kFloat32) * scale).contiguous();  // (S, H, D) fp32, scaled once
  auto tables = block_tables.contiguous(), lens = context_lens.contiguous();
  auto out = torch::empty({S, H, D}, q.options());
  auto run = [&](auto* pool_type) {
    using T = std::remove_pointer_t<decltype(pool_type)>;
    decode_all<T>(qf.data_ptr<float>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables.data_ptr<int64_t>(),
                  lens.data_ptr<int64_t>(), out.data_ptr<T>(), S, H, Hkv, D, tables.size(1), block_size);
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: run((float*)nullptr); break;
    case at::kBFloat16: run((at::BFloat16*)nullptr); break;
    case at::kHalf: run((at::Half*)nullptr); break;
    default: TORCH_CHECK(false, "mt_paged::decode: float32, bfloat16 or float16 pools");
  }
  return out;
}

TORCH_LIBRARY(mt_paged, m) {
  m.def("decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "int block_size, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(mt_paged, CPU, m) {
  m.impl("decode", &decode);
}
"""


@cache
def decode_kernel_available() -> bool:
    """Build and load the C++ kernel (first call in a process: ~30 s, then cached on disk); False where
    it cannot be built or MT_NATIVE_KERNELS=0 asks for the PyTorch reference."""
    return build("mt_paged", _SOURCE, "paged decode attention", fakes={"mt_paged::decode": _decode_shape})


def _decode_shape(q, k_cache, v_cache, block_tables, context_lens, block_size, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def paged_decode_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """paged_decode_attention's arguments and result, computed by the C++ kernel (decode_kernel_available()
    must be True; q and the pools on the CPU, in one of KERNEL_DTYPES)."""
    return torch.ops.mt_paged.decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)
