"""Wrong answers for the docs/06 exercises (scheduler step, prefix-cache lookup, paged decode), each a
whole answer written out here with ONE mistake a learner is likely to make. tests/test_exercises.py adds
them to broken.BROKEN; the page's "break it" list names the same mistakes."""

from __future__ import annotations

import types
from typing import NamedTuple

import torch


# ---------------------------------------------------------------------------- ex06_scheduler_step (docs/06 §5)
class _Plan(NamedTuple):
    scheduled: list
    preempted: list
    waiting_after: list


def _blocks(n, block_size):
    return -(-n // block_size)


def _schedule_step(running, waiting, free, bs, max_num_seqs, budget, *, victim=-1, admit_after_preempt=False,
                   overtake=False, preempted_to_back=False, whole_prompts=False):
    running, waiting = [[s.name, s.num_tokens, s.num_computed_tokens] for s in running], \
        [[s.name, s.num_tokens, 0] for s in waiting]
    scheduled, preempted, i = [], [], 0
    while i < len(running) and budget > 0:
        seq = running[i]
        new = min(seq[1] - seq[2], budget)
        fits = True
        while _blocks(seq[2] + new, bs) - _blocks(seq[2], bs) > free:
            out = running.pop(victim)
            free += _blocks(out[2], bs)
            out[2] = 0
            waiting.append(out) if preempted_to_back else waiting.insert(0, out)
            preempted.append(out[0])
            if out is seq:
                fits = False
                break
        if not fits:
            if victim == 0:
                continue
            break
        free -= _blocks(seq[2] + new, bs) - _blocks(seq[2], bs)
        scheduled.append((seq[0], new))
        budget -= new
        i += 1
    if not preempted or admit_after_preempt:
        j = 0
        while j < len(waiting) and budget > 0 and len(running) < max_num_seqs:
            seq = waiting[j]
            new = seq[1] if whole_prompts else min(seq[1], budget)
            if (whole_prompts and new > budget) or _blocks(new, bs) > free:
                if overtake:
                    j += 1
                    continue
                break
            waiting.pop(j)
            free -= _blocks(new, bs)
            running.append(seq)
            scheduled.append((seq[0], new))
            budget -= new
    return _Plan(scheduled, preempted, [s[0] for s in waiting])


def _ex14(**mistake):
    return types.SimpleNamespace(schedule_step=lambda *state: _schedule_step(*state, **mistake))


# ---------------------------------------------------------------------------- ex06_prefix_cache (docs/06 §4)
class _CachedBlock(NamedTuple):
    block_id: int
    token_ids: tuple
    parent: int | None


def _chain_hash(parent_hash, token_ids):
    return hash((parent_hash, token_ids))


def _block_hashes(tokens, bs, hash_fn=_chain_hash, chained=True):
    hashes, parent = [], None
    for i in range(len(tokens) // bs):
        hashes.append(hash_fn(parent if chained else None, tuple(tokens[i * bs:(i + 1) * bs])))
        parent = hashes[-1]
    return hashes


def _lookup(tokens, bs, cache, hash_fn=_chain_hash, *, token_guard=True, parent_guard=True, whole_prompt=False,
            chained=True):
    looked_at = tokens if whole_prompt else tokens[:len(tokens) - 1]
    hits = []
    for i, h in enumerate(_block_hashes(looked_at, bs, hash_fn, chained)):
        block = cache.get(h)
        ok = block is not None
        ok = ok and (not token_guard or block.token_ids == tuple(tokens[i * bs:(i + 1) * bs]))
        ok = ok and (not parent_guard or block.parent == (hits[-1] if hits else None))
        if not ok:
            break
        hits.append(block.block_id)
    return hits


def _ex15(chained=True, **mistake):
    return types.SimpleNamespace(
        CachedBlock=_CachedBlock, chain_hash=_chain_hash,
        block_hashes=lambda t, bs, hash_fn=_chain_hash: _block_hashes(t, bs, hash_fn, chained),
        lookup=lambda t, bs, cache, hash_fn=_chain_hash: _lookup(t, bs, cache, hash_fn, chained=chained, **mistake))


# ---------------------------------------------------------------------------- ex06_paged_decode (docs/06 §3)
def _paged_decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale,
                  rescale=True, whole_last_block=False, heads_modulo=False):
    S, H, D = q.shape
    Hkv = k_cache.shape[1]
    kv_head = torch.arange(H) % Hkv if heads_modulo else torch.arange(H) // (H // Hkv)
    out = torch.empty(S, H, D, dtype=torch.float64)
    for s in range(S):
        length, query = int(context_lens[s]), q[s].double()
        m = torch.full((H,), float("-inf"), dtype=torch.float64)
        l, acc = torch.zeros(H, dtype=torch.float64), torch.zeros(H, D, dtype=torch.float64)
        for b in range(-(-length // block_size)):
            filled = block_size if whole_last_block else min(block_size, length - b * block_size)
            start = int(block_tables[s, b]) * block_size
            k = k_cache[start:start + filled].double()[:, kv_head]
            v = v_cache[start:start + filled].double()[:, kv_head]
            scores = torch.einsum("hd,nhd->hn", query, k) * scale
            m_new = torch.maximum(m, scores.amax(-1))
            alpha = torch.exp(m - m_new) if rescale else torch.ones(H, dtype=torch.float64)
            p = torch.exp(scores - m_new[:, None])
            l, acc, m = l * alpha + p.sum(-1), acc * alpha[:, None] + torch.einsum("hn,nhd->hd", p, v), m_new
        out[s] = acc / l[:, None]
    return out.to(q.dtype)


def _ex06_paged(**mistake):
    return types.SimpleNamespace(paged_decode=lambda *args: _paged_decode(*args, **mistake))


BROKEN_ENGINE = {
    "ex06_scheduler_step": {
        "the OLDEST running sequence preempted": _ex14(victim=0),
        "new sequences admitted in a step that preempted": _ex14(admit_after_preempt=True),
        "a later waiting sequence overtakes the blocked head": _ex14(overtake=True),
        "a preempted sequence sent to the back of the queue": _ex14(preempted_to_back=True),
        "no chunked prefill: a prompt waits until it fits the budget whole": _ex14(whole_prompts=True),
    },
    "ex06_prefix_cache": {
        "the hash trusted, no token comparison": _ex15(token_guard=False),
        "the parent not checked": _ex15(parent_guard=False),
        "the whole prompt looked up (a fully cached prompt computes nothing)": _ex15(whole_prompt=True),
        "a block hashed without its parent": _ex15(chained=False),
    },
    "ex06_paged_decode": {
        "the running sum and accumulator not rescaled when the max grows": _ex06_paged(rescale=False),
        "the unfilled tail of the last block read as keys": _ex06_paged(whole_last_block=True),
        "query head h paired with kv head h % Hkv": _ex06_paged(heads_modulo=True),
    },
}
