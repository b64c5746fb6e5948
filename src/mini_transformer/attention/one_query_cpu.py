"""One query row against a contiguous K/V cache on the CPU: the compiled batch-1 decode step's attention.

inference/static_cache.py keeps K and V as fixed (B, Hkv, max_len, D) slabs and attends over ALL max_len
slots with a mask (slots not yet written are masked), so the step has one shape. `_one_query_attention` in
inference/cpu_decode.py is the readable reference (scores, softmax, weighted sum of V as reductions inductor
fuses); it reads every slot of the slab, written or not. This kernel (csrc/one_query.cpp) walks only the keys
the mask lets through, with paged_cpu.py's online softmax (csrc/attention_tile.h: the same tile loop, fp32
arithmetic for fp32/bf16/fp16): for each (b, kv head), its G = H/Hkv query heads together, the unmasked keys
are gathered a tile at a time by index (a mask that is -inf, or False, means the K and V rows are never read)
and pass through the tile loop; out = acc / l and logsumexp = m + log l, what aten's CPU flash attention
returns. A row with no key left gets out 0 and logsumexp -inf (the reference would give NaN; sdpa_attention
never passes such a row). One task per (b, kv head), at::parallel_for.

Registered as `mt_one_query::attend` (with a fake for torch.compile), built on first use by `_native.build`;
without AVX2 (or AVX-512) its portable path runs, which still beats the reference (benchmarks/bench_kernels.py).
`kernel_available()` is False where it cannot be built or MINI_TRANSFORMER_NATIVE_KERNELS=0: the reference runs.
"""

from __future__ import annotations

from functools import cache

import torch

from .._native import build
from .paged_cpu import KERNEL_DTYPES

__all__ = ["KERNEL_DTYPES", "kernel_available", "one_query_kernel"]


@cache
def kernel_available() -> bool:
    """Build and load the C++ kernel (first call in a process, then cached on disk); False where it cannot
    be built or MINI_TRANSFORMER_NATIVE_KERNELS=0 asks for the PyTorch reference."""
    return build("mt_one_query", "one_query.cpp", "one-query attention", fakes={"mt_one_query::attend": _attend_shape})


def _attend_shape(q, key, value, attn_mask, scale):
    B, H, _, D = q.shape
    return q.new_empty((B, H, 1, D)), q.new_empty((B, H, 1), dtype=torch.float32)


def one_query_kernel(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row against contiguous keys: q (B, H, 1, D), key/value (B, Hkv, Tk, D), attn_mask None or
    (B or 1, 1, 1, Tk), bool (True = may attend) or additive (-inf = may not) -> (out (B, H, 1, D),
    logsumexp (B, H, 1) fp32). kernel_available() must be True; q, key, value in one of KERNEL_DTYPES."""
    return torch.ops.mt_one_query.attend(q, key, value, attn_mask, scale)
