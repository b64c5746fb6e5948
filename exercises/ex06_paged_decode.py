"""Exercise (docs/06 section 3): decode attention read straight from the paged KV pool, one block at a time.

Fill in `paged_decode`, then grade it:

    uv run pytest exercises/test_ex06_paged_decode.py

The engine keeps K and V in a pool of slots, `block_size` slots per block. Sequence s owns the blocks listed
in block_tables[s]; its key number p (0 <= p < context_lens[s]) sits in slot

    block_tables[s, p // block_size] * block_size + p % block_size

A decode step has ONE new query per sequence. `mini_transformer.attention.paged.paged_decode_attention` is
the readable reference: it gathers every block of every sequence into one padded tensor, masks the tail and
takes a full softmax. Here you do what the project's C++ decode kernel (attention/paged_cpu.py) does
instead: walk the block table one block at a time and keep a running softmax (docs/04's online softmax) —
no gathered copy of the context, no padding, and no slot outside the sequence is ever read.

Shapes: q (S, H, D); k_cache, v_cache (num_slots, Hkv, D) with H a multiple of Hkv (GQA: query head h reads
kv head h // (H // Hkv)); block_tables (S, Bmax) int64, rows padded with block ids that must not be read;
context_lens (S,) int64, each >= 1. Returns (S, H, D) in q's dtype.
"""

from __future__ import annotations

import torch


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """softmax(q · kᵀ · scale) · v for each sequence's one query over its context_lens[s] keys."""
    # TODO 1: for each sequence, keep per query head a running max m, a running sum l and an accumulator acc
    # TODO 2: visit only the blocks that hold its keys, and in the last one only the slots that are filled
    # TODO 3: fold each block's scores into (m, l, acc) so that the result equals one softmax over all keys,
    #         even when a later block holds a larger score than every earlier one
    # TODO 4: each query head reads the kv head of its GQA group; finish with acc / l
    raise NotImplementedError("TODO: ex06_paged_decode, paged_decode")
