// mt_paged::decode: one decode query per sequence against its keys in the engine's paged KV pool, walked
// block by block through the block table with an online softmax (attention_tile.h). Reference:
// attention/paged.py::paged_decode_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_tile.h"
#include "ops.h"

namespace {

// Ask for a block's K and V rows before they are needed: a block lies anywhere in the pool, so no hardware
// prefetcher can guess where it starts. One cache line per row starts it, the row's next lines (consecutive)
// are left to the hardware prefetchers: a prefetch for every line (16 rows x 8 lines x 2 at D=64, fp32) was
// slower, the loop stalling on the few misses a core keeps in flight. __builtin_prefetch is GCC's and clang's.
template <typename T>
static void prefetch_block(const T* k_pool, const T* v_pool, int64_t first_slot, int64_t block_size,
                           int64_t row_stride) {
  for (int64_t t = 0; t < block_size; ++t) {
    __builtin_prefetch(k_pool + (first_slot + t) * row_stride);
    __builtin_prefetch(v_pool + (first_slot + t) * row_stride);
  }
}

// One task: `heads` query heads of one sequence, q (heads, D) fp32 pre-scaled; query head i reads kv head
// i / group of each pool row, counted from k_pool and v_pool (the task's first kv head). Walk the sequence's
// blocks with the online softmax, write out (heads, D).
template <typename T>
static void attend_one(const float* q, const T* k_pool, const T* v_pool, const int64_t* table, int64_t n_keys,
                       int64_t block_size, int64_t row_stride, int64_t heads, int64_t group, int64_t D,
                       float* acc, float* scores, int64_t* rows, T* out) {
  std::vector<float> m(heads, -std::numeric_limits<float>::infinity()), l(heads, 0.f);
  std::fill(acc, acc + heads * D, 0.f);
  for (int64_t start = 0, j = 0; start < n_keys; start += block_size, ++j) {
    const int64_t n = std::min(block_size, n_keys - start);  // keys of this block that exist
    const int64_t first_slot = table[j] * block_size;
    if (start + block_size < n_keys)
      prefetch_block(k_pool, v_pool, table[j + 1] * block_size, block_size, row_stride);
    for (int64_t t = 0; t < n; ++t) rows[t] = (first_slot + t) * row_stride;
    attend_tile(q, k_pool, v_pool, rows, (const float*)nullptr, n, heads, group, D, m.data(), l.data(), acc, scores,
                block_size);
  }
  for (int64_t i = 0; i < heads; ++i)
    for (int64_t d = 0; d < D; ++d) out[i * D + d] = static_cast<T>(acc[i * D + d] / l[i]);
}

// One task per sequence with all its heads where the sequences fill the threads: a pool row holds every kv
// head of a token side by side, so a task reads whole rows (docs/06 §3b). Fewer sequences than threads (a
// batch-1 decode): one task per (sequence, kv head) with its G query heads, so every thread has work. Each
// head's numbers are the same either way (attend_tile treats every head alone), so any thread count gives
// the same bits.
template <typename T>
static void decode_all(const float* q, const T* k_pool, const T* v_pool, const int64_t* tables, const int64_t* lens,
                       T* out, int64_t S, int64_t H, int64_t Hkv, int64_t D, int64_t B, int64_t block_size) {
  const int64_t G = H / Hkv;  // query heads per kv head
  const int64_t kv_per_task = S >= at::get_num_threads() ? Hkv : 1;
  const int64_t tasks_per_seq = Hkv / kv_per_task, heads = kv_per_task * G;
  at::parallel_for(0, S * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(heads * D), scores(heads * block_size);  // scratch, reused by this thread's tasks
    std::vector<int64_t> rows(block_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / tasks_per_seq, kv0 = task % tasks_per_seq * kv_per_task;  // first kv head
      const int64_t offset = s * H * D + kv0 * G * D;  // (S, H, D) row of its first query head
      attend_one(q + offset, k_pool + kv0 * D, v_pool + kv0 * D, tables + s * B, lens[s], block_size, Hkv * D,
                 heads, G, D, acc.data(), scores.data(), rows.data(), out + offset);
    }
  });
}

// q (S, H, D); k_cache, v_cache (num_slots, Hkv, D); block_tables (S, B) int64; context_lens (S,) int64
// -> (S, H, D) in the pool's dtype (float32, bfloat16 or float16)
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                           at::Tensor context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "mt_paged::decode: contiguous pools");
  TORCH_CHECK(q.dtype() == k_cache.dtype() && v_cache.dtype() == k_cache.dtype(), "mt_paged::decode: one dtype");
  TORCH_CHECK(block_tables.dtype() == at::kLong && context_lens.dtype() == at::kLong,
              "mt_paged::decode: int64 block_tables and context_lens");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  auto qf = (q.to(at::kFloat) * scale).contiguous();  // (S, H, D) fp32, scaled once
  auto tables = block_tables.contiguous(), lens = context_lens.contiguous();
  auto out = at::empty({S, H, D}, q.options());
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

}  // namespace

DEFINE_OPS(LIBRARY_NAME(mt_paged), m) {
  m.def("decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "int block_size, float scale) -> Tensor");
  m.def("vectorized() -> bool");
}
IMPLEMENT_OPS(LIBRARY_NAME(mt_paged), CPU, m) {
  m.impl("decode", &paged_decode);
}
IMPLEMENT_OPS(LIBRARY_NAME(mt_paged), CompositeExplicitAutograd, m) {
  m.impl("vectorized", &attention_tile_vectorized);
}
