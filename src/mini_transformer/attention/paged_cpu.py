"""Paged decode attention on the CPU as a hand-written C++ loop: each sequence's pages, one online softmax.

`paged.py::paged_decode_attention` is the readable reference: every (sequence, block, offset) at once,
a softmax over all keys. This kernel (csrc/paged_decode.cpp) computes the same numbers the way
FlashAttention (stage 4, docs/04) walks tiles, with a block of the pool as the tile. For one sequence s and
each of its query heads q_g (pre-scaled by 1/sqrt(D)), it keeps a running max m, a running sum l and an
accumulator acc (D floats), and for each block j of its block table (the keys K_j, values V_j of that
block, only the first context_len positions):

    x    = q_g . K_j^T                        the block's scores            (n,)
    m'   = max(m, max x)
    acc  = acc * exp(m - m') + sum_t exp(x_t - m') V_j[t]
    l    = l   * exp(m - m') + sum_t exp(x_t - m')
    m    = m'
    out_g = acc / l                            after the last block

Nothing is gathered or padded: the block table says where each block lies, and keys past context_len are never
read. One task per sequence (at::parallel_for over sequences) takes all its query heads: a pool row holds
every kv head of a token side by side, so each K/V row comes from memory once for all the heads that read it.
With fewer sequences than threads (batch-1 decode) each (sequence, kv head) is a task, so every thread has
work; each head is walked alone either way, so the bits do not depend on the thread count. The tile loop
(csrc/attention_tile.h, shared with one_query_cpu.py's kernel) runs 16 floats at a time with AVX-512 where the
compiler has it, 8 with AVX2, else its portable C++; 16-bit pools are widened to fp32 as they load, so bf16/fp16
compute in fp32 like the reference.

Registered as the operator `mt_paged::decode` (with a fake for torch.compile); built on first use by
`_native.build`; without AVX2 its portable path runs, which still beats the reference
(benchmarks/bench_kernels.py). `decode_kernel_available()` is False where it cannot be built: callers use
the reference.
"""

from __future__ import annotations

from functools import cache

import torch

from .._native import build

__all__ = ["KERNEL_DTYPES", "decode_kernel_available", "paged_decode_kernel"]

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64 keeps the PyTorch reference


@cache
def decode_kernel_available() -> bool:
    """Build and load the C++ kernel (first call in a process, then cached on disk); False where it cannot
    be built or MINI_TRANSFORMER_NATIVE_KERNELS=0 asks for the PyTorch reference."""
    return build("mt_paged", "paged_decode.cpp", "paged decode attention", fakes={"mt_paged::decode": _decode_shape})


def _decode_shape(q, k_cache, v_cache, block_tables, context_lens, block_size, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def paged_decode_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """paged_decode_attention's arguments and result, computed by the C++ kernel (decode_kernel_available()
    must be True; q and the pools on the CPU, in one of KERNEL_DTYPES)."""
    return torch.ops.mt_paged.decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)
