"""The 4-bit matrix-vector product of a decode step: int4 weights x int8 activations, integer dot products.

A decode step multiplies a few activation rows x (M, K) by every weight matrix. With 4-bit weights the
time is set by how fast the packed bytes stream in, so the product must use each byte where it lands in
a register: unpacking the nibbles to float, or worse writing a dequantized float matrix to memory and
reading it back (8 times the bytes of the packed one), loses what 4 bits saved. ggml's Q4_0 x Q8_0 idea:

  1. quantize each activation row once, per group of `group_size` inputs (the weight's groups):
         dx[g] = max |x[g]| / 127,   xq = round(x / dx)  in [-127, 127]          (K values, int8)
  2. per weight row n and group g, an integer dot product of the 4-bit codes with xq:
         dot[n, g] = sum_k q[n, k] * xq[k]         (q in [0, 15]; exact in int32)
  3. y[n] = sum_g  scale[n, g] * dx[g] * dot[n, g]  +  low[n, g] * sum_{k in g} x[k]
     because w = q * scale + low (Int4Linear's asymmetric groups: low = the group's minimum).

Two implementations of exactly this arithmetic (tests check them against each other and float64):
  * `int4_gemv_reference`: plain PyTorch, readable; used where the C++ kernel cannot be built;
  * the C++ kernel (csrc/int4_gemv.cpp, built on first use by `_native.build`): per 128 inputs, 64 packed
    bytes are loaded once, split into low and high nibbles, and each half meets its 64 int8 activations in
    ONE `vpdpbusd` (AVX512-VNNI, csrc/int4_gemv_avx512.h, for K a multiple of 128 and groups of 64 or 128k);
    with AVX2 instead, or for the other groups of 64k (csrc/int4_gemv_avx2.h), per 64 inputs 32 bytes and two
    `vpmaddubsw` (u8 x s8 pairs to int16) then `vpmaddwd` (to int32); both take 4 weight rows per pass (VNNI at
    group 64), sharing each load of the activations; elsewhere the same sums in portable C++. The packed
    layout is the one Int4Linear saves: byte j of a row holds inputs 2j (low nibble) and 2j+1 (high), so the
    activations are reordered instead (evens, then odds).
It is registered as the operator `mt_gemv::int4`, so a compiled decode step calls it like any aten op.

A row's (G, 2) scale and low sit side by side (`scale_low`, Int4Linear's `gemv_scale_low`): the bytes of a
row are one stream, not two (N, G) arrays. int8 weights do not go this way: they keep the compiled fused
reduction (quantize.py), which an int8 x int8 integer loop would not beat by enough to pay for rounding the
activations (docs/08b §3).
"""

from __future__ import annotations

from functools import cache

import torch

from .._native import build


def kernel_groups_ok(group_size: int) -> bool:
    """The kernel walks a group in chunks of 64 inputs (or 32 for group 32)."""
    return group_size == 32 or group_size % 64 == 0


def int4_gemv_reference(x: torch.Tensor, packed: torch.Tensor, scale_low: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """x (M, K) float32, packed (N, K/2) uint8, scale_low (N, G, 2) -> (M, N) float32: the kernel's
    arithmetic in PyTorch. The integer dot products run as a float32 matmul, which is exact here: every
    product and partial sum is an integer below 15 * 127 * group_size < 2**24 (group_size <= 8192)."""
    M, K = x.shape
    N, G = packed.shape[0], K // group_size
    scale, low = scale_low.unbind(-1)  # (N, G) each
    xg = x.view(M, G, group_size)  # (M, G, group)
    dx = xg.abs().amax(dim=-1) / 127  # (M, G)
    xq = torch.where(dx[..., None] == 0, 0.0, torch.round(xg / dx[..., None]))  # (M, G, group) integers
    q = torch.stack([packed & 15, packed >> 4], dim=-1).view(N, G, group_size).float()  # (N, G, group) codes
    dot = torch.einsum("mgk,ngk->mng", xq, q)  # (M, N, G) exact integers
    return (scale * dx[:, None] * dot).sum(dim=-1) + xg.sum(dim=-1) @ low.T  # (M, N)


@cache
def kernel_available() -> bool:
    """Build and load the C++ kernel (first call in a process); False where it cannot be built or
    MINI_TRANSFORMER_NATIVE_KERNELS=0 asks for the PyTorch reference."""
    return build("mt_gemv", "int4_gemv.cpp", "int4 GEMV", fakes={"mt_gemv::int4": _gemv_shape})


def _gemv_shape(x, weight, scale_low, group_size):
    return x.new_empty(x.shape[0], weight.shape[0])
