// How a GEMV's weight rows are shared among torch's threads (both GEMV kernels): each thread takes one
// contiguous slice of the rows, as many bytes as the others. One slice per thread is one stream per core: read
// front to back, it ramps the prefetchers up once per call and then streams, where slices handed out piece by
// piece (ggml's scheme, a shared counter) restart the ramp at every piece and end the call with one thread
// waiting for the other's last piece; for the small matrices of a decode step that costs more than it saves
// (docs/08b §4). Each row is still summed by one thread in one order: the thread count never changes a bit.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace {

// A thread gets at least this many bytes of weights, else the call keeps fewer threads (below twice this, only
// the calling one): waking a second thread costs about as much as reading this much.
constexpr int64_t kMinBytesPerThread = 128 << 10;

// f(begin, end) over the rows [0, N) of row_bytes each, every row exactly once, on up to torch's threads.
template <class F>
static void parallel_rows(int64_t N, int64_t row_bytes, const F& f) {
  const int64_t threads = std::min<int64_t>({at::get_num_threads(), N * row_bytes / kMinBytesPerThread, N});
  if (threads < 2) return f(0, N);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) f(N * t / threads, N * (t + 1) / threads);
  });
}

}  // namespace
