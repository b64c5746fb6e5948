// How a GEMV's weight rows are shared among torch's threads (both GEMV kernels). The rows are cut into
// contiguous chunks of about kChunkBytes of weights; each thread takes the next chunk from a shared counter
// (ggml's scheme) until none is left. A chunk read front to back spans many of the pages a hardware prefetcher
// stays within, so it streams as well as one half of the matrix would; and a thread that starts late or is
// interrupted leaves its chunks to the others instead of holding up the whole call.
// Each row is still summed by one thread in one order: the thread count never changes a bit.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

// Below two chunks of weights the call runs on the calling thread: waking a second thread costs about as much
// as reading a chunk.
constexpr int64_t kChunkBytes = 128 << 10;

// f(begin, end) over the rows [0, N) of row_bytes each, every row exactly once, on up to torch's threads.
template <class F>
static void parallel_rows(int64_t N, int64_t row_bytes, const F& f) {
  const int64_t chunks = N * row_bytes / kChunkBytes;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads < 2) return f(0, N);
  const int64_t rows = (N + chunks - 1) / chunks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
      f(c * rows, std::min(N, (c + 1) * rows));
  });
}

}  // namespace
