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

Padding every sequence's queries to the longest query would make one 500-token prefill chunk pad 63
decode queries to 500 rows each. So the sequences are split in two groups, each padded on its own:
decode steps (1 query each: (S, H, 1, D)) and the rest (prefill chunks).

    meta = PagedAttentionMetadata.build(block_tables, context_lens, query_lens, block_size, device)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)     # the new tokens' K/V into their slots
    out = paged_attention(q, k_cache, v_cache, meta)         # (N, H, D)

Two layouts of the metadata, one per kind of kernel: GATHERED (the padded groups above, for
`paged_attention`) and BLOCK_TABLE (the block tables and each token's sequence and position, for the
Triton kernel in `triton_paged.py`, which walks the tables itself). `build` makes both unless told
`layouts=(...)`; the engine's runner picks the one its backend reads, once, and builds only that.

Shapes: q (N, H, D) packed; k, v (N, Hkv, D); k_cache, v_cache (num_slots, Hkv, D) for one layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .naive import naive_attention

__all__ = ["BLOCK_TABLE", "GATHERED", "LAYOUTS", "PagedAttentionMetadata", "paged_attention", "write_kv"]


@dataclass
class PaddedGroup:
    """Some of the step's sequences, laid out for one contiguous attention call.

    key_slots (S, Lmax): the slot of every key each sequence sees, left-padded (padding reads slot 0).
    key_padding_mask (S, Lmax): True = a real key.
    token_index (n,): which packed tokens (rows of q) belong to this group, in order.
    padded_index (n,): where each of them sits in the flattened right-aligned (S * Qmax) query layout.
    """

    key_slots: torch.Tensor
    key_padding_mask: torch.Tensor
    token_index: torch.Tensor
    padded_index: torch.Tensor
    num_seqs: int
    max_query_len: int


GATHERED, BLOCK_TABLE = "gathered", "block_table"
LAYOUTS = (GATHERED, BLOCK_TABLE)


def check_layouts(layouts) -> tuple[str, ...]:
    """A non-empty sequence of LAYOUTS, as a tuple: what `PagedAttentionMetadata.build` may be asked for.
    Checked once by whoever fixes the layouts (the engine, from its backend), not at every step."""
    if isinstance(layouts, str) or not isinstance(layouts, Sequence) or not layouts or not set(layouts) <= set(LAYOUTS):
        raise ValueError(f"layouts={layouts!r} must be a non-empty sequence of {LAYOUTS}")
    return tuple(layouts)


@dataclass
class PagedAttentionMetadata:
    """Where every token of one engine step lives, built once per step (every layer reuses it).

    slot_mapping (N,): the slot each new token's K/V is written to (vLLM's name). Always built.
    groups: the decode sequences and the prefill sequences, each padded on its own (GATHERED layout;
    empty when not built).
    block_tables (S, Bmax) int32, token_seq (N,), token_pos (N,): what the Triton kernel reads instead
    (each token's sequence and position; it walks the block table itself). None unless the BLOCK_TABLE
    layout was built.
    """

    slot_mapping: torch.Tensor
    groups: list[PaddedGroup]
    block_tables: torch.Tensor | None
    token_seq: torch.Tensor | None
    token_pos: torch.Tensor | None
    block_size: int
    layouts: tuple[str, ...] = LAYOUTS

    @classmethod
    def build(cls, block_tables: Sequence[Sequence[int]], context_lens: Sequence[int],
              query_lens: Sequence[int], block_size: int, device: torch.device | str = "cpu",
              layouts: Sequence[str] = LAYOUTS):
        """block_tables[s]: block ids of sequence s; context_lens[s]: its keys after this step (cached +
        new); query_lens[s]: its new tokens, the last query_lens[s] of its keys. `layouts`: which of
        GATHERED and BLOCK_TABLE to build (the slot mapping comes with either), checked once by its owner
        with `check_layouts` (the engine builds metadata every step and trusts it). Plain Python lists in,
        a few index tensors out. They are built on the CPU (the host knows all of this from scheduling)
        and copied to `device` once: no value is ever read back from the device."""
        lens = zip(block_tables, context_lens, query_lens, strict=True)
        assert all(0 < n_new <= n_keys <= len(table) * block_size for table, n_keys, n_new in lens)
        max_blocks = max(len(table) for table in block_tables)
        tables = torch.tensor([list(t) + [0] * (max_blocks - len(t)) for t in block_tables])  # (S, Bmax)
        token_seq = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))  # (N,)
        token_pos = torch.cat([torch.arange(k - n, k) for k, n in zip(context_lens, query_lens, strict=True)])
        slot_mapping = tables[token_seq, token_pos // block_size] * block_size + token_pos % block_size  # (N,)
        meta = cls(slot_mapping=slot_mapping.to(device), groups=[], block_tables=None, token_seq=None,
                   token_pos=None, block_size=block_size, layouts=tuple(layouts))
        if GATHERED in layouts:
            meta.groups = _padded_groups(tables, context_lens, query_lens, block_size, device)
        if BLOCK_TABLE in layouts:
            meta.block_tables = tables.to(device=device, dtype=torch.int32)
            meta.token_seq, meta.token_pos = token_seq.to(device), token_pos.to(device)
        return meta


def _padded_groups(tables: torch.Tensor, context_lens, query_lens, block_size: int, device
                   ) -> list[PaddedGroup]:
    """The GATHERED layout: decode steps in one group, prefill chunks in another, each padded on its own."""
    first_token = [0]
    for n in query_lens:
        first_token.append(first_token[-1] + n)
    groups = []
    for in_group in (lambda n: n == 1, lambda n: n > 1):  # decode steps, then prefill chunks
        members = [s for s, n in enumerate(query_lens) if in_group(n)]
        if not members:
            continue
        group = _pad_group(tables[members], [context_lens[s] for s in members],
                           [query_lens[s] for s in members], [first_token[s] for s in members], block_size)
        groups.append(PaddedGroup(*(t.to(device) for t in group), num_seqs=len(members),
                                  max_query_len=max(query_lens[s] for s in members)))
    return groups


def _pad_group(tables: torch.Tensor, context_lens, query_lens, first_tokens, block_size: int):
    """The left-padded key slots and right-aligned query places of some sequences (CPU tensors);
    tables (S, Bmax) are their block tables, padded with block 0."""
    max_context, max_query = max(context_lens), max(query_lens)
    as_long = dict(dtype=torch.long)
    n_keys = torch.tensor(context_lens, **as_long)[:, None]  # (S, 1)
    n_new = torch.tensor(query_lens, **as_long)[:, None]  # (S, 1)
    columns = torch.arange(max_context, **as_long)  # (Lmax,)
    positions = columns - (max_context - n_keys)  # (S, Lmax): left padding gets negative positions
    keep = positions >= 0
    positions = positions.clamp(min=0)
    key_slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
    key_slots = key_slots.masked_fill(~keep, 0)  # (S, Lmax)
    query_rows = torch.arange(max_query, **as_long) >= max_query - n_new  # (S, Qmax), right-aligned
    token_index = torch.cat([torch.arange(f, f + n) for f, n in zip(first_tokens, query_lens, strict=True)])
    padded_index = query_rows.flatten().nonzero().squeeze(1)  # (n,) sequence by sequence, ascending
    return key_slots, keep, token_index, padded_index


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
    `meta` must hold the GATHERED layout (the engine chose its layout once, from the backend; this runs in
    every layer of every step and trusts it). Returns (N, H, D) in the order of q."""
    attend = attend or _naive
    N, H, D = q.shape
    out = q.new_empty(N, H, D)
    for group in meta.groups:
        S, Qmax = group.num_seqs, group.max_query_len
        k = k_cache[group.key_slots].transpose(1, 2)  # (S, Lmax, Hkv, D) -> (S, Hkv, Lmax, D)
        v = v_cache[group.key_slots].transpose(1, 2)  # (S, Hkv, Lmax, D)
        padded_q = q.new_zeros(S * Qmax, H, D)
        padded_q[group.padded_index] = q[group.token_index]
        padded_q = padded_q.view(S, Qmax, H, D).transpose(1, 2)  # (S, H, Qmax, D), queries right-aligned
        group_out = attend(padded_q, k, v, group.key_padding_mask)  # (S, H, Qmax, D)
        out[group.token_index] = group_out.transpose(1, 2).reshape(S * Qmax, H, D)[group.padded_index]
    return out
