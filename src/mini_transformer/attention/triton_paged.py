"""Paged attention as one Triton kernel that reads the block table itself (no gathered copy of K/V).

One program per (sequence, query of that sequence, query head), reading the step's attention metadata
(block_tables, context_lens, query_start_loc: see paged.py). Query i of sequence s is packed token
query_start_loc[s] + i and sits at position p = context_len - query_len + i. The program walks the
block table for the blocks that cover keys 0..p, loads one block of keys and values per iteration
straight from the pool (slot = block_id * block_size + offset) and keeps an online softmax (running
max m, sum l, accumulator) in registers — the FlashAttention recurrence of `triton_flash.py`, one query
row at a time. Decode steps, prefill chunks and whole prompts are the same program: a token simply
sees the keys up to its own position.

A single query row is a vector, so scores are `sum(k * q)` rather than `tl.dot` (which wants 16-row
tiles): no tensor cores, no minimum head size. Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import math

import torch

# triton (or None without it), the jit that degrades to a no-op and the masked-score constant are
# triton_flash's: one import of triton for both kernels
from .paged import PagedAttention, PagedAttentionMetadata
from .triton_flash import MASKED, _jit, tl, triton

__all__ = ["TritonPagedAttention", "triton_paged_attention"]


@_jit
def _paged_kernel(Q, K, V, O, BLOCK_TABLES, CONTEXT_LENS, QUERY_START_LOC,
                  stride_qt, stride_qh, stride_ks, stride_kh, stride_bt, group, head_dim, scale,
                  BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    seq, qi, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(QUERY_START_LOC + seq)
    query_len = tl.load(QUERY_START_LOC + seq + 1) - start
    if qi >= query_len:  # the grid is sized for the longest query of the step
        return
    token = start + qi
    pos = tl.load(CONTEXT_LENS + seq) - query_len + qi  # this query sees keys 0..pos of its own sequence
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(Q + token * stride_qt + h * stride_qh + dims, mask=dim_ok, other=0.0).to(tl.float32)
    kv_head = (h // group) * stride_kh  # GQA: query head h reads kv head h // group
    offsets = tl.arange(0, BLOCK_SIZE)
    m = tl.max(tl.full([BLOCK_SIZE], MASKED, tl.float32), 0)  # running max (a float32 scalar)
    l = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), 0)  # running sum
    acc = tl.zeros([BLOCK_D], tl.float32)  # running numerator
    for i in range(0, pos // BLOCK_SIZE + 1):
        block_id = tl.load(BLOCK_TABLES + seq * stride_bt + i).to(tl.int64)
        visible = i * BLOCK_SIZE + offsets <= pos  # (BLOCK_SIZE,)
        kv_off = (block_id * BLOCK_SIZE + offsets)[:, None] * stride_ks + kv_head + dims[None, :]
        kv_ok = visible[:, None] & dim_ok[None, :]
        k = tl.load(K + kv_off, mask=kv_ok, other=0.0).to(tl.float32)  # (BLOCK_SIZE, BLOCK_D)
        s = tl.where(visible, tl.sum(k * q[None, :], 1) * scale, MASKED)  # (BLOCK_SIZE,)
        m_new = tl.maximum(m, tl.max(s, 0))
        p = tl.where(visible, tl.exp(s - m_new), 0.0)
        alpha = tl.exp(m - m_new)
        v = tl.load(V + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
        l = l * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m = m_new
    out = acc / l  # l >= 1: the token always sees at least itself
    tl.store(O + token * stride_qt + h * stride_qh + dims, out.to(O.dtype.element_ty), mask=dim_ok)


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedAttentionMetadata, scale: float | None = None) -> torch.Tensor:
    """q (N, H, D) packed new tokens; k_cache, v_cache (num_slots, Hkv, D) one layer's pool, the new
    tokens' K/V already written; meta: the step's fields (paged.py). Returns (N, H, D). The block size
    must be a power of two. Runs in every layer of every step, so it trusts its arguments: LLMEngine checked
    the block size, triton and the device once (`triton_flash.check_triton`)."""
    block_size = meta.block_size
    q = q.contiguous()
    N, H, D = q.shape
    assert k_cache.stride(2) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    block_tables = meta.block_tables
    S = block_tables.shape[0]
    _paged_kernel[(S, meta.max_query_len, H)](
        q, k_cache, v_cache, out, block_tables, meta.context_lens, meta.query_start_loc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        H // k_cache.shape[1], D, scale, BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(D),
    )
    return out


class TritonPagedAttention(PagedAttention):
    """The engine's paged attention on the `triton` backend: one kernel serves decode rows and prefill
    chunks alike, so both methods are that kernel (no gathered copy for prefill either)."""

    def decode(self, q, k_cache, v_cache, meta: PagedAttentionMetadata) -> torch.Tensor:
        return triton_paged_attention(q, k_cache, v_cache, meta)

    def prefill(self, q, k_cache, v_cache, meta: PagedAttentionMetadata, attend=None) -> torch.Tensor:
        return triton_paged_attention(q, k_cache, v_cache, meta)
