// How the kernels name their operator libraries. The ordinary build registers mt_float, mt_gemv, mt_paged and
// mt_one_query; the build of every kernel's portable path (AVX-512 off, compiled with MINI_TRANSFORMER_PORTABLE:
// tests and benchmarks/bench_kernels.py) adds "_portable" to each name, so both builds load in one process.
#pragma once
#include <torch/library.h>

#ifdef MINI_TRANSFORMER_PORTABLE
#define LIBRARY_NAME(name) name##_portable
#else
#define LIBRARY_NAME(name) name
#endif

// One macro between the caller and TORCH_LIBRARY, so LIBRARY_NAME(...) is expanded before it is pasted.
#define DEFINE_OPS(name, m) TORCH_LIBRARY(name, m)
#define IMPLEMENT_OPS(name, key, m) TORCH_LIBRARY_IMPL(name, key, m)
