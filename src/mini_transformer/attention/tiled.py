"""FlashAttention in plain PyTorch: blocks of queries x blocks of keys, online softmax, no T x T matrix.

Forward (the FlashAttention-2 recurrence), for one block of queries and key blocks j = 1, 2, ...:

    s_j   = q k_j^T * scale                      scores of this key block         (bq, bk)
    m_new = max(m, rowmax(s_j))                  running row maximum
    p_j   = exp(s_j - m_new)                     probabilities, unnormalised
    alpha = exp(m - m_new)                       how much the old maximum over-counted
    l     = alpha * l + rowsum(p_j)              running softmax denominator
    acc   = alpha * acc + p_j v_j                running numerator
    out   = acc / l,   lse = m + log(l)          at the end (lse = log-sum-exp of the row)

Backward (FlashAttention): p_j is recomputed as exp(s_j - lse) from q, k and the saved lse, so only
O(T) numbers are kept between forward and backward. With dO the output gradient and
delta = rowsum(dO * out):

    dv_j += p_j^T dO,   dp_j = dO v_j^T,   ds_j = p_j * (dp_j - delta),
    dq   += ds_j k_j * scale,   dk_j += ds_j^T q * scale.

Same semantics as `naive.py`: queries sit at the end of the keys (query i has absolute position
Tk - Tq + i), key_padding_mask True = real key, GQA (query head h uses kv head h // G), and a row
that sees no key gives zeros. Key blocks entirely above the causal diagonal are never touched.
"""

from __future__ import annotations

import torch

from .._checks import positive_int

__all__ = ["TiledAttention", "check_tiled", "key_block_ranges", "tiled_attention", "tiled_attention_backward",
           "tiled_attention_forward"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and accumulators: float64 stays float64 (for the tests), everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tiled(dropout_p: float, block_q: int = 128, block_k: int = 128) -> None:
    """What the tiled backend can run, checked once where it is chosen (attention(), the model's door):
    no attention dropout, positive block sizes. `tiled_attention` trusts its arguments."""
    if dropout_p > 0.0:
        raise ValueError(
            f"dropout_p={dropout_p}: the tiled backend has no attention dropout; use backend='naive' or 'sdpa'"
        )
    positive_int("block_q", block_q)
    positive_int("block_k", block_k)


def key_block_ranges(q_start: int, q_end: int, Tq: int, Tk: int, *, causal: bool, block_k: int):
    """Yield (k_start, k_end) for the key blocks the queries q_start .. q_end - 1 must visit.

    Causal: query i (absolute position Tk - Tq + i) sees keys 0 .. Tk - Tq + i, so the block's last
    query sees keys < Tk - Tq + q_end; key blocks starting at or after that lie entirely above the
    diagonal and are skipped.
    """
    key_end = min(Tk, Tk - Tq + q_end) if causal else Tk
    for k_start in range(0, key_end, block_k):
        yield k_start, min(k_start + block_k, Tk)


def _visible(q_start, q_end, k_start, k_end, *, Tq, Tk, causal, keep, device):
    """(B|1, 1, 1, bq, bk) bool, True = query may see key; None when the whole block is visible."""
    mask = None
    offset = Tk - Tq
    if causal and k_end - 1 > offset + q_start:  # the block crosses the diagonal
        q_pos = torch.arange(q_start, q_end, device=device) + offset  # absolute positions (bq,)
        k_pos = torch.arange(k_start, k_end, device=device)  # (bk,)
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None, None]  # (1, 1, 1, bq, bk)
    if keep is not None:
        real = keep[:, k_start:k_end][:, None, None, None, :]  # (B, 1, 1, 1, bk)
        mask = real if mask is None else mask & real
    return mask


def tiled_attention_forward(q, k, v, *, causal, key_padding_mask, scale, block_q=128, block_k=128):
    """Returns out (B, H, Tq, D) in q's dtype and lse (B, H, Tq) in the compute dtype.

    lse[b, h, i] = log sum_j exp(score_ij) over the keys query i may see; -inf for a row that sees no key.
    """
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = H // Hkv
    dt = _compute_dtype(q.dtype)
    neg = torch.finfo(dt).min  # a finite "minus infinity": max(neg, neg) - neg is 0, never NaN
    q_grouped = q.reshape(B, Hkv, G, Tq, D)  # query heads grouped by the kv head they share
    out = q.new_empty(B, Hkv, G, Tq, D)
    lse = q.new_empty(B, Hkv, G, Tq, dtype=dt)

    for q_start in range(0, Tq, block_q):
        q_end = min(q_start + block_q, Tq)
        q_blk = q_grouped[:, :, :, q_start:q_end].to(dt) * scale  # (B, Hkv, G, bq, D)
        m = q_blk.new_full((B, Hkv, G, q_end - q_start, 1), neg)  # running max      (B, Hkv, G, bq, 1)
        l = q_blk.new_zeros((B, Hkv, G, q_end - q_start, 1))  # running sum           (B, Hkv, G, bq, 1)
        acc = torch.zeros_like(q_blk)  # running numerator                              (B, Hkv, G, bq, D)
        for k_start, k_end in key_block_ranges(q_start, q_end, Tq, Tk, causal=causal, block_k=block_k):
            k_blk = k[:, :, None, k_start:k_end].to(dt)  # (B, Hkv, 1, bk, D): shared by the G heads
            v_blk = v[:, :, None, k_start:k_end].to(dt)  # (B, Hkv, 1, bk, D)
            s = q_blk @ k_blk.transpose(-2, -1)  # (B, Hkv, G, bq, bk)
            mask = _visible(q_start, q_end, k_start, k_end, Tq=Tq, Tk=Tk, causal=causal,
                            keep=key_padding_mask, device=q.device)
            if mask is not None:
                s = s.masked_fill(~mask, neg)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # (B, Hkv, G, bq, 1)
            p = torch.exp(s - m_new)  # (B, Hkv, G, bq, bk)
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)  # a fully masked block would otherwise give exp(0) = 1
            alpha = torch.exp(m - m_new)  # rescales what was summed under the old maximum
            l = alpha * l + p.sum(dim=-1, keepdim=True)
            acc = alpha * acc + p @ v_blk  # (B, Hkv, G, bq, D)
            m = m_new
        seen = l > 0  # False for a row that sees no key at all: its acc is 0, keep it 0
        out[:, :, :, q_start:q_end] = (acc / torch.where(seen, l, 1.0)).to(q.dtype)
        lse[:, :, :, q_start:q_end] = (m + torch.log(l)).squeeze(-1)  # log(0) = -inf for an empty row
    return out.reshape(B, H, Tq, D), lse.reshape(B, H, Tq)


def tiled_attention_backward(grad_out, q, k, v, out, lse, *, causal, key_padding_mask, scale,
                             block_q=128, block_k=128):
    """Gradients (dq, dk, dv) from the saved q, k, v, out and lse; probabilities are recomputed per block."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = H // Hkv
    dt = _compute_dtype(q.dtype)
    q_grouped = q.reshape(B, Hkv, G, Tq, D)
    do_grouped = grad_out.reshape(B, Hkv, G, Tq, D).to(dt)
    # delta_i = sum_d dO_id out_id = sum_j p_ij dp_ij: the softmax Jacobian's correction term, per row
    delta = (do_grouped * out.reshape(B, Hkv, G, Tq, D).to(dt)).sum(dim=-1, keepdim=True)  # (B, Hkv, G, Tq, 1)
    # A row that saw no key has lse = -inf; every p of it is masked to 0 below, so any finite value will do.
    lse = lse.reshape(B, Hkv, G, Tq, 1).masked_fill(torch.isneginf(lse.reshape(B, Hkv, G, Tq, 1)), 0.0)
    dq = torch.zeros(B, Hkv, G, Tq, D, dtype=dt, device=q.device)
    dk = torch.zeros(B, Hkv, Tk, D, dtype=dt, device=q.device)
    dv = torch.zeros(B, Hkv, Tk, D, dtype=dt, device=q.device)

    for q_start in range(0, Tq, block_q):
        q_end = min(q_start + block_q, Tq)
        q_blk = q_grouped[:, :, :, q_start:q_end].to(dt)  # (B, Hkv, G, bq, D)
        do_blk = do_grouped[:, :, :, q_start:q_end]  # (B, Hkv, G, bq, D)
        lse_blk, delta_blk = lse[:, :, :, q_start:q_end], delta[:, :, :, q_start:q_end]  # (B, Hkv, G, bq, 1)
        for k_start, k_end in key_block_ranges(q_start, q_end, Tq, Tk, causal=causal, block_k=block_k):
            k_blk = k[:, :, None, k_start:k_end].to(dt)  # (B, Hkv, 1, bk, D)
            v_blk = v[:, :, None, k_start:k_end].to(dt)  # (B, Hkv, 1, bk, D)
            p = torch.exp((q_blk @ k_blk.transpose(-2, -1)) * scale - lse_blk)  # (B, Hkv, G, bq, bk)
            mask = _visible(q_start, q_end, k_start, k_end, Tq=Tq, Tk=Tk, causal=causal,
                            keep=key_padding_mask, device=q.device)
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)
            dv[:, :, k_start:k_end] += (p.transpose(-2, -1) @ do_blk).sum(dim=2)  # sum the G heads: (B, Hkv, bk, D)
            dp = do_blk @ v_blk.transpose(-2, -1)  # (B, Hkv, G, bq, bk)
            ds = p * (dp - delta_blk)  # gradient of the scores (B, Hkv, G, bq, bk)
            dq[:, :, :, q_start:q_end] += (ds @ k_blk) * scale  # (B, Hkv, G, bq, D)
            dk[:, :, k_start:k_end] += (ds.transpose(-2, -1) @ q_blk).sum(dim=2) * scale  # (B, Hkv, bk, D)
    return dq.reshape(B, H, Tq, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class TiledAttention(torch.autograd.Function):
    """Autograd saves q, k, v, out and lse (all O(T)); backward recomputes the probabilities block by block."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, causal, scale, block_q, block_k):
        out, lse = tiled_attention_forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                                           scale=scale, block_q=block_q, block_k=block_k)
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask)
        ctx.settings = dict(causal=causal, scale=scale, block_q=block_q, block_k=block_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, key_padding_mask = ctx.saved_tensors
        dq, dk, dv = tiled_attention_backward(grad_out, q, k, v, out, lse, key_padding_mask=key_padding_mask,
                                              **ctx.settings)
        return dq, dk, dv, None, None, None, None, None


def tiled_attention(q, k, v, *, causal, key_padding_mask, dropout_p, scale, block_q=128, block_k=128):
    """The `tiled` backend: same call as every backend, plus the block sizes. Returns (B, H, Tq, D).
    Trusts its arguments (`check_tiled` ran once where the backend was chosen: dropout_p is 0)."""
    return TiledAttention.apply(q, k, v, key_padding_mask, causal, float(scale), block_q, block_k)
