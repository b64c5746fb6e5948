"""Exercise answered the way the project's C++ decode kernel (attention/paged_cpu.py) walks the pool: one
block at a time with a running max and sum, reading only the slots the sequence has filled."""

import torch


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale):
    S, H, D = q.shape
    group = H // k_cache.shape[1]
    work = torch.promote_types(q.dtype, torch.float32)
    kv_head = torch.arange(H) // group  # query head h reads kv head h // group
    out = torch.empty(S, H, D, dtype=work)
    for s in range(S):
        length, query = int(context_lens[s]), q[s].to(work)  # (H, D)
        m = torch.full((H,), float("-inf"), dtype=work)
        l, acc = torch.zeros(H, dtype=work), torch.zeros(H, D, dtype=work)
        for b in range((length + block_size - 1) // block_size):
            filled = min(block_size, length - b * block_size)
            start = int(block_tables[s, b]) * block_size
            k = k_cache[start:start + filled].to(work)[:, kv_head]  # (filled, H, D)
            v = v_cache[start:start + filled].to(work)[:, kv_head]
            scores = torch.einsum("hd,nhd->hn", query, k) * scale  # (H, filled)
            m_new = torch.maximum(m, scores.amax(-1))
            alpha, p = torch.exp(m - m_new), torch.exp(scores - m_new[:, None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[:, None] + torch.einsum("hn,nhd->hd", p, v)
            m = m_new
        out[s] = acc / l[:, None]
    return out.to(q.dtype)
