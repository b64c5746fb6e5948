"""FlashAttention as fused Triton kernels: one forward kernel, two backward kernels (dK/dV and dQ).

The algorithm is the one written out in `tiled.py`; here each (query block, head) is one Triton
program that keeps its running max m, sum l and accumulator in registers, so the scores never
touch memory. Scores and accumulators are float32 whatever the input dtype; masked scores get a
large finite negative (not -inf, so a fully masked first block cannot produce inf - inf = NaN).

Backward: `delta = rowsum(dO * out)` (a tiny PyTorch op), then
  * dK/dV kernel: one program per (key block, kv head) walks every query block of every query head
    in its GQA group, so it owns its dK/dV rows and needs no atomics;
  * dQ kernel: one program per (query block, head) walks the key blocks.
Both recompute p = exp(s - lse) from the saved log-sum-exp.

Runs on CUDA. On CPU it runs only under the Triton interpreter (TRITON_INTERPRET=1 set before
triton is first imported): slow, for tests at small sizes.
"""

from __future__ import annotations

import torch

from .._checks import choice, power_of_two

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; check_triton explains what is missing
    triton = tl = None

__all__ = ["TritonAttention", "check_triton", "triton_attention"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PRECISIONS = ("ieee", "tf32", "tf32x3")
_jit = triton.jit if triton is not None else (lambda fn: fn)
# finite stand-in for -inf in float32 scores; kernels may only read globals that are constexpr
MASKED = tl.constexpr(-1.0e30) if tl is not None else -1.0e30


@_jit
def _visible(rows, keys, Tq, Tk, keep_row, CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr):
    """(BLOCK_M, BLOCK_N) bool: query `rows` may see `keys` (queries sit at the end of the keys)."""
    ok = (rows[:, None] < Tq) & (keys[None, :] < Tk)
    if CAUSAL:
        ok = ok & (keys[None, :] <= rows[:, None] + (Tk - Tq))
    if HAS_KEEP:
        real = tl.load(keep_row + keys, mask=keys < Tk, other=0)
        ok = ok & (real[None, :] != 0)
    return ok


@_jit
def _fwd_kernel(Q, K, V, O, LSE, KEEP, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                n_heads, group, Tq, Tk, head_dim, scale,
                CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // n_heads, pid_bh % n_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q_off = b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + dims[None, :]  # (BLOCK_M, BLOCK_D)
    q = tl.load(Q + q_off, mask=(rows[:, None] < Tq) & (dims[None, :] < head_dim), other=0.0)
    kv_base = b * stride_kb + (h // group) * stride_kh  # GQA: head h reads kv head h // group
    m = tl.full([BLOCK_M], MASKED, tl.float32)  # running max
    l = tl.zeros([BLOCK_M], tl.float32)  # running sum
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running numerator
    key_end = Tk
    if CAUSAL:  # skip key blocks entirely above the diagonal
        key_end = tl.minimum(Tk, (Tk - Tq) + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, key_end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        kv_off = kv_base + keys[:, None] * stride_kt + dims[None, :]  # (BLOCK_N, BLOCK_D)
        kv_ok = (keys[:, None] < Tk) & (dims[None, :] < head_dim)
        k = tl.load(K + kv_off, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N) float32
        visible = _visible(rows, keys, Tq, Tk, KEEP + b * Tk, CAUSAL, HAS_KEEP)
        s = tl.where(visible, s, MASKED)
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off, mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    seen = l > 0.0  # a row that sees no key keeps acc = 0 and gets out = 0
    l_safe = tl.where(seen, l, 1.0)
    out = acc / l_safe[:, None]
    tl.store(O + q_off, out.to(O.dtype.element_ty), mask=(rows[:, None] < Tq) & (dims[None, :] < head_dim))
    # lse of an empty row: 0 (its p are masked to 0 in the backward, any finite value works)
    tl.store(LSE + pid_bh * Tq + rows, tl.where(seen, m + tl.log(l_safe), 0.0), mask=rows < Tq)


@_jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, KEEP, stride_qb, stride_qh, stride_qt,
                     stride_kb, stride_kh, stride_kt, n_kv_heads, group, Tq, Tk, head_dim, scale,
                     CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    b, kv_h = pid_bh // n_kv_heads, pid_bh % n_kv_heads
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    kv_off = b * stride_kb + kv_h * stride_kh + keys[:, None] * stride_kt + dims[None, :]  # (BLOCK_N, BLOCK_D)
    kv_ok = (keys[:, None] < Tk) & (dims[None, :] < head_dim)
    k = tl.load(K + kv_off, mask=kv_ok, other=0.0)
    v = tl.load(V + kv_off, mask=kv_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    q_start = 0
    if CAUSAL:  # query i sees key j only if i >= j - (Tk - Tq): earlier query blocks are skipped
        q_start = (tl.maximum(pid_n * BLOCK_N - (Tk - Tq), 0) // BLOCK_M) * BLOCK_M
    for g in range(0, group):  # every query head that reads this kv head
        h = kv_h * group + g
        for start_m in range(q_start, Tq, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            q_off = b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + dims[None, :]
            q_ok = (rows[:, None] < Tq) & (dims[None, :] < head_dim)
            q = tl.load(Q + q_off, mask=q_ok, other=0.0)
            do = tl.load(DO + q_off, mask=q_ok, other=0.0)
            lse = tl.load(LSE + (b * n_kv_heads * group + h) * Tq + rows, mask=rows < Tq, other=0.0)
            delta = tl.load(DELTA + (b * n_kv_heads * group + h) * Tq + rows, mask=rows < Tq, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N)
            visible = _visible(rows, keys, Tq, Tk, KEEP + b * Tk, CAUSAL, HAS_KEEP)
            p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=kv_ok)


@_jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, KEEP, stride_qb, stride_qh, stride_qt,
                   stride_kb, stride_kh, stride_kt, n_heads, group, Tq, Tk, head_dim, scale,
                   CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // n_heads, pid_bh % n_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q_off = b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + dims[None, :]
    q_ok = (rows[:, None] < Tq) & (dims[None, :] < head_dim)
    q = tl.load(Q + q_off, mask=q_ok, other=0.0)
    do = tl.load(DO + q_off, mask=q_ok, other=0.0)
    lse = tl.load(LSE + pid_bh * Tq + rows, mask=rows < Tq, other=0.0)
    delta = tl.load(DELTA + pid_bh * Tq + rows, mask=rows < Tq, other=0.0)
    kv_base = b * stride_kb + (h // group) * stride_kh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    key_end = Tk
    if CAUSAL:
        key_end = tl.minimum(Tk, (Tk - Tq) + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, key_end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        kv_off = kv_base + keys[:, None] * stride_kt + dims[None, :]
        kv_ok = (keys[:, None] < Tk) & (dims[None, :] < head_dim)
        k = tl.load(K + kv_off, mask=kv_ok, other=0.0)
        v = tl.load(V + kv_off, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = _visible(rows, keys, Tq, Tk, KEEP + b * Tk, CAUSAL, HAS_KEEP)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty), mask=q_ok)


def _kernels_are_interpreted() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1: the kernels then run on CPU in numpy."""
    return type(_fwd_kernel).__name__ == "InterpretedFunction"


def _blocks(head_dim: int, dtype: torch.dtype, backward: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Compiled offline for sm_80 and sm_90 (D = 16..128, fp16,
    bf16, fp32), these tiles need at most 96.25 KiB of shared memory (fp32, D = 128, the dK/dV kernel; 64 KiB
    forward; 40.5 KiB for fp16/bf16): under the 99 KiB of sm_86/89. The test compiles two of these for sm_90."""
    small = head_dim <= 64 and dtype != torch.float32
    if backward:
        return (64, 64, 4, 2) if small else (32, 32, 4, 2)
    if small:
        return 128, 64, 8, 3
    return (64, 32, 4, 3) if head_dim <= 64 else (32, 32, 4, 2)


class TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keep, causal, scale, precision, block_m, block_n):
        B, H, Tq, D = q.shape
        Hkv, Tk = k.shape[1], k.shape[2]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q)
        lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
        bm, bn, warps, stages = _blocks(D, q.dtype, backward=False)
        bm, bn = block_m or bm, block_n or bn
        grid = (triton.cdiv(Tq, bm), B * H)
        _fwd_kernel[grid](q, k, v, out, lse, keep if keep is not None else q, *q.stride()[:3], *k.stride()[:3],
                          H, H // Hkv, Tq, Tk, D, scale, CAUSAL=causal, HAS_KEEP=keep is not None,
                          PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn,
                          BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=warps, num_stages=stages)
        ctx.save_for_backward(q, k, v, out, lse, keep)
        ctx.settings = (causal, scale, precision, block_m, block_n)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, keep = ctx.saved_tensors
        causal, scale, precision, block_m, block_n = ctx.settings
        B, H, Tq, D = q.shape
        Hkv, Tk = k.shape[1], k.shape[2]
        do = grad_out.contiguous()
        delta = (do.float() * out.float()).sum(dim=-1)  # (B, H, Tq): rowsum(dO * out)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bm, bn, warps, stages = _blocks(D, q.dtype, backward=True)
        bm, bn = block_m or bm, block_n or bn
        common = dict(CAUSAL=causal, HAS_KEEP=keep is not None, PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=warps, num_stages=stages)
        keep_arg = keep if keep is not None else q
        strides = (*q.stride()[:3], *k.stride()[:3])
        _bwd_dkdv_kernel[(triton.cdiv(Tk, bn), B * Hkv)](q, k, v, do, lse, delta, dk, dv, keep_arg, *strides,
                                                          Hkv, H // Hkv, Tq, Tk, D, scale, **common)
        _bwd_dq_kernel[(triton.cdiv(Tq, bm), B * H)](q, k, v, do, lse, delta, dq, keep_arg, *strides,
                                                      H, H // Hkv, Tq, Tk, D, scale, **common)
        return dq, dk, dv, None, None, None, None, None, None


def check_triton(dtype: torch.dtype, head_dim: int, device: torch.device, *, dropout_p: float = 0.0,
                 input_precision: str = "ieee", block_m: int | None = None, block_n: int | None = None) -> None:
    """What the triton backend can run, checked once where it is chosen (attention(), the model's and the
    engine's doors): the kernels themselves trust their arguments."""
    if triton is None:
        raise ImportError("backend='triton' needs the `triton` package (pip install triton); "
                          "or use backend='tiled' (same algorithm in PyTorch) or 'sdpa'")
    if dropout_p > 0.0:
        raise ValueError(f"dropout_p={dropout_p}: the triton backend has no attention dropout; "
                         "use backend='naive' or 'sdpa'")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {dtype}; the triton backend supports float16, bfloat16 and float32")
    if not 16 <= head_dim <= 128:
        raise ValueError(f"head dim D={head_dim} is not supported by the triton backend; expected 16 <= D <= 128")
    choice("input_precision", input_precision, PRECISIONS)
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is not None:
            power_of_two(name, value, low=16)
    if torch.device(device).type != "cuda" and not _kernels_are_interpreted():
        raise ValueError(f"q is on device {torch.device(device).type!r}: the triton backend runs on CUDA tensors, "
                         "or on CPU only when TRITON_INTERPRET=1 was set before triton was first imported")


def triton_attention(q, k, v, *, causal, key_padding_mask, dropout_p, scale, input_precision="ieee",
                     block_m=None, block_n=None):
    """The `triton` backend. input_precision applies to float32 inputs: "ieee" (exact, the default),
    "tf32" (tensor cores, about 1e-3 relative error) or "tf32x3". block_m/block_n override the tiles.
    Trusts its arguments: `check_triton` said once that they can run (dropout_p is 0)."""
    keep = None if key_padding_mask is None else key_padding_mask.to(torch.int8).contiguous()
    return TritonAttention.apply(q, k, v, keep, causal, float(scale), input_precision, block_m, block_n)
