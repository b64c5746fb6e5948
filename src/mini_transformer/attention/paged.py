"""Paged attention: the queries of many sequences against keys and values kept in a pool of blocks.

The serving engine keeps K/V in a pool of slots, `block_size` slots per block. A sequence owns a list of
blocks, its block table; the key at position p of that sequence lives in slot

    slot = block_table[p // block_size] * block_size + p % block_size

One step of the engine packs the new tokens of every scheduled sequence into one row (N tokens, no
padding). Each sequence contributes `query_len` new tokens that are the END of its `context_len` keys
(a decode step: 1 of L; a prefill chunk or a prefix-cache hit: a suffix; a whole prompt: all of them).

This pure-PyTorch version gathers each sequence's keys through its block table into a left-padded
(S, Hkv, Lmax, D) tensor, places its queries right-aligned in (S, H, Qmax, D) and runs the ordinary
attention backend with a key padding mask. Left-padded keys and right-aligned queries keep the project's
rule "queries sit at the end of the keys" for every sequence at once, so the backend needs no new mask
logic. It copies each context once per layer: simple and exact, not the fastest (vLLM's kernel reads
the blocks in place).

    meta = PagedAttentionMetadata.build(block_tables, context_lens, query_lens, block_size, device)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)     # the new tokens' K/V into their slots
    out = paged_attention(q, k_cache, v_cache, meta)         # (N, H, D)

Shapes: q (N, H, D) packed; k, v (N, Hkv, D); k_cache, v_cache (num_slots, Hkv, D) for one layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .naive import naive_attention

__all__ = ["PagedAttentionMetadata", "paged_attention", "write_kv"]


@dataclass
class PagedAttentionMetadata:
    """Where every token of one engine step lives, built once per step (every layer reuses it).

    slot_mapping (N,): the slot each new token's K/V is written to (vLLM's name).
    key_slots (S, Lmax): the slot of every key each sequence sees, left-padded (padding reads slot 0).
    key_padding_mask (S, Lmax): True = a real key.
    query_index (N,): where each packed query sits in the flattened right-aligned (S * Qmax) layout.
    """

    slot_mapping: torch.Tensor
    key_slots: torch.Tensor
    key_padding_mask: torch.Tensor
    query_index: torch.Tensor
    num_seqs: int
    max_query_len: int

    @classmethod
    def build(cls, block_tables: Sequence[Sequence[int]], context_lens: Sequence[int],
              query_lens: Sequence[int], block_size: int, device: torch.device | str = "cpu"):
        """block_tables[s]: block ids of sequence s; context_lens[s]: its keys after this step (cached +
        new); query_lens[s]: its new tokens, the last query_lens[s] of its keys. Plain Python lists in,
        a few index tensors out. They are built on the CPU (the host knows all of this from scheduling)
        and copied to `device` once: no value is ever read back from the device."""
        lens = zip(block_tables, context_lens, query_lens, strict=True)
        assert all(0 < n_new <= n_keys <= len(table) * block_size for table, n_keys, n_new in lens)
        num_seqs, max_blocks = len(context_lens), max(len(table) for table in block_tables)
        max_context, max_query = max(context_lens), max(query_lens)
        as_long = dict(dtype=torch.long)
        tables = torch.tensor([list(t) + [0] * (max_blocks - len(t)) for t in block_tables], **as_long)  # (S, Bmax)
        n_keys = torch.tensor(context_lens, **as_long)[:, None]  # (S, 1)
        n_new = torch.tensor(query_lens, **as_long)[:, None]  # (S, 1)
        columns = torch.arange(max_context, **as_long)  # (Lmax,)
        positions = columns - (max_context - n_keys)  # (S, Lmax): left padding gets negative positions
        keep = positions >= 0
        positions = positions.clamp(min=0)
        key_slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
        key_slots = key_slots.masked_fill(~keep, 0)  # (S, Lmax)
        is_new = columns >= max_context - n_new  # (S, Lmax): the last n_new keys are this step's tokens
        query_rows = torch.arange(max_query, **as_long) >= max_query - n_new  # (S, Qmax), right-aligned
        return cls(
            slot_mapping=key_slots[is_new].to(device),  # (N,) sequence by sequence, positions ascending
            key_slots=key_slots.to(device),
            key_padding_mask=keep.to(device),
            query_index=query_rows.flatten().nonzero().squeeze(1).to(device),  # (N,)
            num_seqs=num_seqs,
            max_query_len=max_query,
        )


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' keys and values (N, Hkv, D) in their slots of the pool (num_slots, Hkv, D).
    (vLLM calls this `reshape_and_cache`.)"""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def _naive(q, k, v, key_padding_mask):
    return naive_attention(q, k, v, causal=True, key_padding_mask=key_padding_mask, dropout_p=0.0,
                           scale=1.0 / math.sqrt(q.shape[-1]))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of the packed queries q (N, H, D) over each sequence's keys in the pool.

    `attend(q, k, v, key_padding_mask)` is a contiguous attention (causal, queries at the end of the keys),
    by default the naive reference; the model passes its own `Attend`, so the configured backend runs.
    Returns (N, H, D) in the order of q."""
    N, H, D = q.shape
    S, Qmax = meta.num_seqs, meta.max_query_len
    Hkv = k_cache.shape[1]
    k = k_cache[meta.key_slots].transpose(1, 2)  # (S, Lmax, Hkv, D) -> (S, Hkv, Lmax, D)
    v = v_cache[meta.key_slots].transpose(1, 2)  # (S, Hkv, Lmax, D)
    padded_q = q.new_zeros(S * Qmax, H, D)
    padded_q[meta.query_index] = q
    padded_q = padded_q.view(S, Qmax, H, D).transpose(1, 2)  # (S, H, Qmax, D), queries right-aligned
    assert k.shape == (S, Hkv, meta.key_slots.shape[1], D)
    out = (attend or _naive)(padded_q, k, v, meta.key_padding_mask)  # (S, H, Qmax, D)
    out = out.transpose(1, 2).reshape(S * Qmax, H, D)  # (S * Qmax, H, D)
    return out[meta.query_index]  # (N, H, D)
