"""The matrix-vector product of a CPU decode step in fp32, bf16 or fp16: weights read once, summed in fp32.

At batch 1 a decode step multiplies one activation row by every weight matrix, and each weight is used
once: the step's time is the time to stream the weights in from memory. bf16/fp16 weights are half fp32's
bytes, so the same step can run up to twice as fast - if the weights stream at the memory's speed.

The kernel (csrc/float_gemv.cpp, built on first use by `_native.build`) does, for x (M, K) and W (N, K), M <= 8:

    y[m, n] = round( sum_k x[m, k] * W[n, k]  (+ bias[n]) )     the sum in fp32, rounded ONCE to x's dtype

  * W is read FRONT TO BACK, one row after the other: one sequential stream, which the core's hardware
    prefetcher recognises (rows read side by side make short streams it keeps losing: docs/08b §4); a software
    prefetch 2 KB ahead keeps more of it in flight than the hardware asks for alone;
  * 4 independent fp32 accumulators per activation row, so an add never waits for the previous one;
    each 64-byte piece of W is loaded once into a register and used for every activation row (<= 4 at a
    time; rows 5-8 read the weight row again, from L1);
  * bf16: `vdpbf16ps` (AVX512_BF16) - 32 bf16 pairs, each product exact in fp32, added pairwise into 16 fp32
    lanes; an AVX-512 CPU without it (Skylake to Ice Lake) widens bf16 on load, as AVX2 does. fp16: 16 halves
    widened with `vcvtph2ps`, then fused multiply-add. fp32: fused multiply-add;
  * with AVX2 instead of AVX-512 (csrc/float_gemv_avx2.h): 8 lanes, 16-bit weights widened as they load
    (fp16 by F16C, bf16 by a 16-bit shift: it is the top half of an fp32), the activations widened to fp32
    once per call;
  * rows of W split over threads with at::parallel_for; each row is summed by one thread in one order,
    so every thread count gives the same bits.

Both SIMD paths share one loop (csrc/float_gemv.cpp); each header gives it its element types. Beside them the
portable path (16 independent fp32 sums per row in plain C++) does not beat PyTorch's own matmul (about even in
fp32, slower in bf16: benchmarks/bench_kernels.py), so `kernel_available` says False where a dtype would run it
and the compiled step keeps PyTorch's.

Where fp32 matters in a 16-bit model: the GEMV sums here (a bf16 running sum of 768 terms would keep ~3
significant digits); RMSNorm (layers.py computes mean(x^2) and the rsqrt in fp32, then rounds); attention
scores, softmax and the sum over keys; the loss (cross-entropy on fp32 logits). Stored activations and the KV
cache stay 16-bit - the places eager `F.linear` (fp32 accumulation, one rounding) rounds too.

`float_gemv_reference` is the same arithmetic in PyTorch (fp32 matmul of the widened values, rounded
once); the operator is `mt_float::gemv`, with a shape function so a compiled step calls it like an aten op.

The same loop reads int8 weights too (`mt_float::gemv_int8`, for quantize.py's Int8Linear in a compiled decode
step): each weight widened to fp32 as it loads, the fp32 sum times the row's scale. Its reference is
quantize.py's `int8_rowwise`, the multiply-and-sum inductor fuses where the kernel is not built.
"""

from __future__ import annotations

from functools import cache

import torch

from .._native import build

MAX_ROWS = 8  # a decode step's matmul with at most this many rows (batch x 1 token) takes the kernel
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def float_gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K), weight (N, K), bias (N,) or None, one dtype -> (M, N) of that dtype: the kernel's arithmetic
    (the values widened to fp32, the sum in fp32, one rounding) in PyTorch."""
    y = x.float() @ weight.float().t()  # (M, N) fp32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@cache
def kernel_available(dtype: torch.dtype) -> bool:
    """Build and load the C++ kernel (first call in a process). True only where weights of `dtype` (one of
    DTYPES, or torch.int8 for gemv_int8) run a SIMD path (AVX-512, or AVX2 with FMA and F16C): the portable
    one does not beat PyTorch's matmul or inductor's fused reduction."""
    if dtype not in (*DTYPES, torch.int8) or not build(
            "mt_float", "float_gemv.cpp", "float GEMV",
            fakes={"mt_float::gemv": _gemv_shape, "mt_float::gemv_int8": _int8_gemv_shape}):
        return False
    return bool(torch.ops.mt_float.vectorized(dtype))


def _gemv_shape(x, weight, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])


def _int8_gemv_shape(x, weight, scales, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])


def takes(mat1: torch.Tensor, mat2: torch.Tensor) -> bool:
    """Whether the decode step's mm(mat1 (M, K), mat2 (K, N)) goes to the kernel: fp32/bf16/fp16, a few rows,
    on the CPU, mat2 a transposed (N, K) weight laid out row by row (as nn.Linear's), and the kernel built."""
    return (mat1.dtype == mat2.dtype and mat1.dim() == mat2.dim() == 2 and mat1.shape[0] <= MAX_ROWS
            and mat1.device.type == "cpu" and mat2.t().is_contiguous() and kernel_available(mat1.dtype))


def float_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias) -> (M, N): the kernel where it is built, else the reference."""
    if x.device.type == "cpu" and kernel_available(x.dtype):
        return torch.ops.mt_float.gemv(x, weight, bias)
    return float_gemv_reference(x, weight, bias)
