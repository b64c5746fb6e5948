// How the kernels name their operator libraries. The ordinary build registers mt_float, mt_gemv, mt_paged,
// mt_one_query and mt_fused; the narrower builds of _native.build_variant (tests, benchmarks/bench_kernels.py) add
// "_portable" (AVX2 and AVX-512 off, MINI_TRANSFORMER_PORTABLE), "_avx2" (AVX-512 off, MINI_TRANSFORMER_AVX2) or
// "_avx512" (AVX-512 without BF16 and VNNI, MINI_TRANSFORMER_AVX512) to each name, so every build loads in one process.
#pragma once
#include <torch/library.h>

#if defined(MINI_TRANSFORMER_PORTABLE)
#define LIBRARY_NAME(name) name##_portable
#elif defined(MINI_TRANSFORMER_AVX2)
#define LIBRARY_NAME(name) name##_avx2
#elif defined(MINI_TRANSFORMER_AVX512)
#define LIBRARY_NAME(name) name##_avx512
#else
#define LIBRARY_NAME(name) name
#endif

// One macro between the caller and TORCH_LIBRARY, so LIBRARY_NAME(...) is expanded before it is pasted.
#define DEFINE_OPS(name, m) TORCH_LIBRARY(name, m)
#define IMPLEMENT_OPS(name, key, m) TORCH_LIBRARY_IMPL(name, key, m)
