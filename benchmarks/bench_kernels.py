"""Each C++ kernel of csrc/ three ways at a decode-sized shape of the 124.7M Llama (768 hidden, GQA 12/4, D 64):
its SIMD build (AVX-512 or AVX2, whichever the machine has), its portable build (both off: the plain C++ path) and
the PyTorch code that runs where no kernel is used, taking turns in one process. Where the portable path
loses to PyTorch, the kernel module runs PyTorch on machines without the SIMD path (csrc/README.md).

  float GEMV    x (1, 768) @ W (2048, 768)^T, fp32 and bf16; PyTorch: F.linear (fp32 sums, one rounding)
  int4 GEMV     x (1, 768) against 2048 int4 rows, groups of 64; PyTorch: int4_gemv_reference
  paged decode  4 sequences of 256 keys in blocks of 16, fp32; PyTorch: paged_decode_attention
  one query     one row against a 384-slot slab, 256 keys visible, fp32; PyTorch: the compiled decomposition
                inductor runs without the kernel (cpu_decode._one_query_attention)

    OMP_NUM_THREADS=1 python benchmarks/bench_kernels.py --threads 1 [--quick]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn.functional as F
from _common import LLAMA_124M, add_common_args, apply_common_args, load_average, table, time_interleaved

from mini_transformer import _native
from mini_transformer.attention import one_query_cpu, paged_cpu
from mini_transformer.attention.paged import paged_decode_attention
from mini_transformer.inference import cpu_decode
from mini_transformer.model import float_gemv, int4_gemv
from mini_transformer.model.quantize import Int4Linear

C = LLAMA_124M["d_model"]
H, HKV = LLAMA_124M["n_heads"], LLAMA_124M["n_kv_heads"]
D = C // H
N = LLAMA_124M["d_ff"]


def float_gemv_calls(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    x, w = torch.randn(1, C).to(dtype), torch.randn(N, C).to(dtype)
    return {"SIMD": lambda: torch.ops.mt_float.gemv(x, w, None),
            "portable": lambda: torch.ops.mt_float_portable.gemv(x, w, None),
            "PyTorch": lambda: F.linear(x, w)}


def int4_calls() -> dict[str, Callable[[], object]]:
    layer = Int4Linear.from_linear(torch.nn.Linear(C, N, bias=False), 64)
    x, packed, scale_low = torch.randn(1, C), layer.weight, layer.gemv_scale_low
    return {"SIMD": lambda: torch.ops.mt_gemv.int4(x, packed, scale_low, 64),
            "portable": lambda: torch.ops.mt_gemv_portable.int4(x, packed, scale_low, 64),
            "PyTorch": lambda: int4_gemv.int4_gemv_reference(x, packed, scale_low, 64)}


def paged_calls() -> dict[str, Callable[[], object]]:
    sequences, context, block = 4, 256, 16
    blocks = sequences * context // block
    k_cache, v_cache = torch.randn(blocks * block, HKV, D), torch.randn(blocks * block, HKV, D)
    tables = torch.randperm(blocks).view(sequences, -1)  # (S, blocks per sequence), shuffled
    lens = torch.full((sequences,), context)
    q = torch.randn(sequences, H, D)
    args = (tables, lens, block, 1 / math.sqrt(D))
    return {"SIMD": lambda: torch.ops.mt_paged.decode(q, k_cache, v_cache, *args),
            "portable": lambda: torch.ops.mt_paged_portable.decode(q, k_cache, v_cache, *args),
            "PyTorch": lambda: paged_decode_attention(q, k_cache, v_cache, *args)}


def one_query_calls() -> dict[str, Callable[[], object]]:
    slab, visible = 384, 256
    q, k, v = torch.randn(1, H, 1, D), torch.randn(1, HKV, slab, D), torch.randn(1, HKV, slab, D)
    mask = (torch.arange(slab) < visible).view(1, 1, 1, slab)
    without_kernel = mock.patch.object(cpu_decode, "_one_query_kernel_takes", lambda *args: False)
    compiled = torch.compile(lambda q, k, v, mask: cpu_decode._one_query_attention(q, k, v, attn_mask=mask,
                                                                                    scale=D ** -0.5),
                             dynamic=False, fullgraph=True)

    def reference():
        with without_kernel:
            return compiled(q, k, v, mask)

    return {"SIMD": lambda: torch.ops.mt_one_query.attend(q, k, v, mask, D ** -0.5),
            "portable": lambda: torch.ops.mt_one_query_portable.attend(q, k, v, mask, D ** -0.5),
            "PyTorch": reference}


def measure(name: str, calls: dict[str, Callable[[], object]], inner: int, repeats: int) -> str:
    """The three ways in turns, `inner` calls per timed run; a table of us per call, ratio vs PyTorch."""
    timings = time_interleaved({way: lambda f=f: [f() for _ in range(inner)] for way, f in calls.items()},
                               repeats=repeats, warmup=2)
    rows = [dict(way=way, us=1e6 * timing.median / inner) for way, timing in timings.items()]
    return f"### {name}\n\n" + table(rows, {"way": "build", "us": "us per call"}, ratio=("us", "PyTorch"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, threads=1, device=False, plot=None)
    parser.add_argument("--quick", action="store_true", help="fewer calls and repeats (a smoke run)")
    args = parser.parse_args()
    apply_common_args(args)
    built = [float_gemv.kernel_available(torch.float32), int4_gemv.kernel_available(),
             paged_cpu.decode_kernel_available(), one_query_cpu.kernel_available(), _native.build_variant("portable")]
    if not all(built):
        raise SystemExit("the SIMD and portable kernels must both build here (AVX2 or AVX-512 and a compiler)")
    inner, repeats = (20, 5) if args.quick else (200, 15)
    print(f"## csrc kernels: SIMD, portable, PyTorch ({args.threads} thread(s), {load_average()})\n")
    cases = [("float GEMV fp32", float_gemv_calls(torch.float32)), ("int4 GEMV", int4_calls()),
             ("paged decode fp32", paged_calls()), ("one query fp32", one_query_calls())]
    if float_gemv.kernel_available(torch.bfloat16):
        cases.insert(1, ("float GEMV bf16", float_gemv_calls(torch.bfloat16)))
    for name, calls in cases:
        print(measure(name, calls, inner, repeats) + "\n")


if __name__ == "__main__":
    main()
