"""The small per-token steps of a layer, fused: RMSNorm, RoPE, SiLU-and-multiply, and the greedy argmax.

Written in PyTorch, RMSNorm is six ops (pow, mean, add, rsqrt, mul, mul), RoPE five per tensor (mul, chunk,
neg, cat, mul, add) and SwiGLU's gate two (silu, mul): each a dispatch from Python and a pass over memory.
In a serving step of a few dozen rows the arithmetic is nothing and those passes are the time; on a prefill
chunk of hundreds of rows each pass reads and writes megabytes. csrc/fused_ops.cpp does each in one pass
over its rows, as vLLM's CPU backend does (its `rms_norm`, `rotary_embedding`, `silu_and_mul` ops).
`torch.argmax` over a (rows, vocab) logits table is a slow reduction on the CPU; the kernel's is one pass.

    rms_norm(x, weight, eps)   rope(x, cos, sin)   silu_mul(gate, up)   argmax_rows(logits)

Each takes the kernel for CPU fp32 inference (no autograd, not under torch.compile, which fuses these
itself) and its reference below otherwise; the numbers differ from the reference by float rounding only.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from .._native import build
from .rope import apply_rope as rope_reference  # x * cos + rotate_half(x) * sin


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., C) -> weight * x / sqrt(mean(x^2) + eps), in fp32 (as Llama), rounded back to x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (weight * x32.to(x.dtype)).to(x.dtype)  # weight * normalised, as HF Llama rounds it


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(gate) * up, elementwise."""
    return F.silu(gate) * up


@cache
def kernel_available() -> bool:
    """Build and load csrc/fused_ops.cpp (first call in a process); False where it cannot be built."""
    return build("mt_fused", "fused_ops.cpp", "fused ops", fakes={
        "mt_fused::rms_norm": lambda x, weight, eps: torch.empty_like(x),
        "mt_fused::rope": lambda x, cos, sin: x.new_empty(x.shape),
        "mt_fused::silu_mul": lambda gate, up: torch.empty_like(gate),
        "mt_fused::argmax": lambda x: x.new_empty(x.shape[:-1], dtype=torch.long)})


def _takes(*tensors: torch.Tensor) -> bool:
    """CPU fp32 inference, outside torch.compile, with the kernel built."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and not torch.compiler.is_compiling() and kernel_available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_contiguous() and _takes(x, weight):
        return torch.ops.mt_fused.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D) (any strides but the last's); cos, sin (B or 1, 1, T, D)."""
    if (x.dim() == 4 and x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape == sin.shape and cos.shape[0] in (1, x.shape[0]) and cos.shape[1] == 1
            and cos.shape[2:] == x.shape[2:] and _takes(x, cos, sin)):
        return torch.ops.mt_fused.rope(x, cos, sin)
    return rope_reference(x, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape and _takes(gate, up):
        return torch.ops.mt_fused.silu_mul(gate, up)
    return silu_mul_reference(gate, up)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """(M, V) -> (M,) int64, the first index of each row's maximum (finite logits)."""
    if logits.dim() == 2 and logits.is_contiguous() and _takes(logits):
        return torch.ops.mt_fused.argmax(logits)
    return logits.argmax(dim=-1)
