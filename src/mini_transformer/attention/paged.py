"""Paged attention: the queries of many sequences against keys and values kept in a pool of blocks.

The serving engine keeps K/V in a pool of slots, `block_size` slots per block. A sequence owns a list of
blocks, its block table; the key at position p of that sequence lives in slot

    slot = block_table[p // block_size] * block_size + p % block_size

One step of the engine packs the new tokens of every scheduled sequence into one row (N tokens, no
padding). Each sequence contributes `query_len` new tokens that are the END of its `context_len` keys
(a decode step: 1 of L; a prefill chunk or a prefix-cache hit: a suffix; a whole prompt: all of them).

The step's inputs are four tensors with vLLM's attention-metadata names, built once per step on the host
and copied to the device in ONE copy (pinned memory, non_blocking on CUDA):

    slot_mapping (N,)       where each new token's K/V is written
    block_tables (S, Bmax)  each sequence's block ids (rows padded with block 0)
    context_lens (S,)       each sequence's keys after this step (cached + new)
    query_start_loc (S+1,)  sequence s owns packed tokens query_start_loc[s] .. query_start_loc[s+1]-1

(flash-attn's own API names differ: block_table, cache_seqlens, cu_seqlens_q/k, max_seqlen_q/k.)

The engine attends through ONE object, chosen when its runner is built (`paged_attention_for`), with two
methods that read only those fields:
  decode(q, k_cache, v_cache, meta)           every row one query. `paged_decode_attention` is the readable
      reference (run eagerly it gathers the blocks): `PagedAttention` runs it as it is,
      `CompiledPagedAttention` through torch.compile (inductor turns the `[block_tables]` indexing into
      loads inside the reductions), `CpuPagedAttention` runs the C++ kernel of `paged_cpu.py` instead: each
      task (a sequence, or a (sequence, kv head) when the sequences are fewer than the threads) walks its
      block table with an online softmax, no gathered copy, no padding (the FlashAttention idea of stage 4
      applied to pages). On a GPU, triton_paged.py's TritonPagedAttention
      runs one Triton kernel for both methods.
  prefill(q, k_cache, v_cache, meta, attend)  a step with prefill rows (a chunk of queries): their keys
      gathered (one index_select for all of them), then each sequence's chunk through the model's own
      contiguous attention, unpadded (queries sit at the end of the keys, so no new mask logic; a whole
      prompt takes the backend's causal fast path). This copy pays where many queries share each key.
      Decode rows in the same step go through `decode`.

    meta = PagedAttentionMetadata.build(block_tables, context_lens, query_lens, block_size, device)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)     # the new tokens' K/V into their slots
    attention = paged_attention_for("cpu", torch.float32)   # once, when the engine is built
    if meta.is_decode_only:                                 # the step, as engine/paged_batch.py runs it
        out = attention.decode(q, k_cache, v_cache, meta)   # (N, H, D)
    else:
        out = attention.prefill(q, k_cache, v_cache, meta, attend)

Shapes: q (N, H, D) packed; k, v (N, Hkv, D); k_cache, v_cache (num_slots, Hkv, D) for one layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from .naive import naive_attention
from .paged_cpu import KERNEL_DTYPES, decode_kernel_available

__all__ = ["CompiledPagedAttention", "CpuPagedAttention", "PagedAttention", "PagedAttentionMetadata",
           "paged_attention_for", "paged_decode_attention", "write_kv"]

@dataclass
class PagedAttentionMetadata:
    """Where every token of one engine step lives, built once per step (every layer reuses it).

    The four tensors are on the device; `query_lens` and `context_lens_host` are the host's copies (plain
    ints the host decided while scheduling), so nothing here is ever read back from the device."""

    slot_mapping: torch.Tensor  # (N,) int64
    block_tables: torch.Tensor  # (S, Bmax) int64
    context_lens: torch.Tensor  # (S,) int64
    query_start_loc: torch.Tensor  # (S+1,) int64
    block_size: int
    query_lens: tuple[int, ...]
    context_lens_host: tuple[int, ...]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(cls, block_tables, context_lens: Sequence[int], query_lens: Sequence[int], block_size: int,
              device: torch.device | str = "cpu"):
        """block_tables: a list of block-id lists, or an (S, >= Bmax) integer array whose rows are already
        padded (the engine's persistent BlockTable); context_lens[s]: sequence s's keys after this step;
        query_lens[s]: its new tokens, the last query_lens[s] of its keys. Computed in numpy on the host,
        packed into one buffer and copied to `device` once (pinned + non_blocking on CUDA)."""
        ctx = np.asarray(context_lens, dtype=np.int64)
        new = np.asarray(query_lens, dtype=np.int64)
        if isinstance(block_tables, np.ndarray):
            tables = block_tables[:, :max(1, -(-int(ctx.max()) // block_size))].astype(np.int64, copy=False)
        else:
            width = max(len(t) for t in block_tables)
            tables = np.zeros((len(block_tables), width), dtype=np.int64)
            for row, table in zip(tables, block_tables, strict=True):
                row[:len(table)] = table
        assert len(ctx) == len(new) == len(tables) and (new > 0).all() and (new <= ctx).all()
        assert (ctx <= tables.shape[1] * block_size).all()
        query_start_loc = np.concatenate([[0], np.cumsum(new)])  # (S+1,)
        token_seq = np.repeat(np.arange(len(new)), new)  # (N,) each token's sequence
        token_pos = np.arange(len(token_seq)) - query_start_loc[token_seq] + (ctx - new)[token_seq]  # (N,)
        slot_mapping = tables[token_seq, token_pos // block_size] * block_size + token_pos % block_size
        parts = (slot_mapping, tables.reshape(-1), ctx, query_start_loc)
        packed = torch.from_numpy(np.concatenate(parts))
        device = torch.device(device)
        if device.type == "cuda":  # an async copy needs page-locked memory; from pageable memory it would sync
            packed = packed.pin_memory()
        packed = packed.to(device, non_blocking=True)
        slots, flat_tables, ctx_t, qsl = packed.split([p.size for p in parts])
        return cls(slots, flat_tables.view(tables.shape), ctx_t, qsl, block_size,
                   tuple(new.tolist()), tuple(ctx.tolist()))

    def rows(self, decode: bool) -> list[int]:
        """The sequences with one query (decode rows) or with several (prefill rows), in order."""
        return [s for s, n in enumerate(self.query_lens) if (n == 1) == decode]

    @cached_property
    def decode_part(self) -> tuple[torch.Tensor, PagedAttentionMetadata] | None:
        """The decode rows of a mixed step as a decode-only step of their own: their packed tokens (S_d,)
        and their metadata; None without decode rows. Made on first use, reused by every layer."""
        seqs = self.rows(decode=True)
        if not seqs:
            return None
        rows = torch.tensor(seqs, device=self.slot_mapping.device)  # (S_d,)
        tokens = self.query_start_loc[rows]  # (S_d,): a decode row's one token
        query_start_loc = torch.arange(len(seqs) + 1, device=rows.device)
        meta = PagedAttentionMetadata(self.slot_mapping[tokens], self.block_tables[rows], self.context_lens[rows],
                                      query_start_loc, self.block_size, (1,) * len(seqs),
                                      tuple(self.context_lens_host[s] for s in seqs))
        return tokens, meta

    @cached_property
    def prefill_keys(self) -> tuple[torch.Tensor, list[tuple[int, int, int, int]]]:
        """For the prefill rows' sequences: the pool slots of all their keys, one sequence after another
        (sum of their context_lens,), derived on the device from the block tables; and, from the host's
        lengths, per sequence (first packed query, queries, first of its keys in that list, keys)."""
        seqs = self.rows(decode=False)
        n_keys = np.array([self.context_lens_host[s] for s in seqs])
        key_start = np.cumsum(n_keys) - n_keys
        owner = np.repeat(np.asarray(seqs), n_keys)  # each key's sequence
        position = np.arange(n_keys.sum()) - np.repeat(key_start, n_keys)  # each key's position in it
        both = torch.from_numpy(np.stack([owner, position])).to(self.slot_mapping.device, non_blocking=True)
        owner_t, position_t = both
        bs = self.block_size
        slots = self.block_tables[owner_t, position_t // bs] * bs + position_t % bs
        query_start = np.concatenate([[0], np.cumsum(self.query_lens)])
        spans = [(int(query_start[s]), self.query_lens[s], int(k0), int(n))
                 for s, k0, n in zip(seqs, key_start, n_keys, strict=True)]
        return slots, spans


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' keys and values (N, Hkv, D) in their slots of the pool (num_slots, Hkv, D).
    (vLLM calls this `reshape_and_cache`.)"""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float) -> torch.Tensor:
    """One query per sequence, q (S, H, D), over its keys read through its block table (S, B).

    Written for every (sequence, block, offset) at once; run eagerly it does gather the blocks, compiled
    the gather becomes the loads of the two reductions (scores over D, the weighted sum over the keys).
    Keys past a sequence's context_len (the tail of its last block, padding blocks) get -inf."""
    S, H, D = q.shape
    Hkv = k_cache.shape[1]
    G, B = H // Hkv, block_tables.shape[1]
    # fp32 arithmetic for 16-bit pools, as the contiguous backends accumulate: compiled or eager, the
    # engine's decode then rounds like generate() does (bf16 sums in bf16 flipped greedy near-ties)
    work = torch.promote_types(q.dtype, torch.float32)  # float32 for 16-bit pools, float64 stays float64
    k = k_cache.view(-1, block_size, Hkv, D)[block_tables].to(work)  # (S, B, block_size, Hkv, D)
    v = v_cache.view(-1, block_size, Hkv, D)[block_tables].to(work)
    out_dtype, q = q.dtype, q.to(work).view(S, 1, 1, Hkv, G, D)  # GQA: query head h reads kv head h // G
    scores = (q * k.unsqueeze(4)).sum(-1) * scale  # (S, B, block_size, Hkv, G)
    key_pos = torch.arange(B * block_size, device=q.device).view(1, B, block_size, 1, 1)
    scores = scores.masked_fill(key_pos >= context_lens.view(S, 1, 1, 1, 1), float("-inf"))
    weights = scores.view(S, B * block_size, Hkv, G).softmax(dim=1)  # (S, L, Hkv, G)
    out = (weights.unsqueeze(-1) * v.view(S, B * block_size, Hkv, 1, D)).sum(1)  # (S, Hkv, G, D)
    return out.view(S, H, D).to(out_dtype)


def _naive(q, k, v, key_padding_mask):
    return naive_attention(q, k, v, causal=True, key_padding_mask=key_padding_mask, dropout_p=0.0,
                           scale=1.0 / math.sqrt(q.shape[-1]))


class PagedAttention:
    """The engine's paged attention: `decode` runs the reference `paged_decode_attention` eagerly (off the
    CPU, or with enforce_eager where the C++ kernel does not run); subclasses swap in another decode."""

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: PagedAttentionMetadata) -> torch.Tensor:
        """One query per row of `meta`: q (S, H, D) -> (S, H, D)."""
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.block_size,
                                      1.0 / math.sqrt(q.shape[-1]))

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata,
                attend: Callable | None = None) -> torch.Tensor:
        """Causal attention of the packed queries q (N, H, D) of a step with prefill rows. Decode rows go
        through `decode`; prefill rows have their keys gathered, then per sequence `attend(q, k, v, None)`
        (model/cache.py's AttendFn; default: the naive reference; the model passes its own `Attend`, so the
        configured backend runs).
        Returns (N, H, D) in the order of q."""
        attend = attend or _naive
        N, H, D = q.shape
        out = q.new_empty(N, H, D)
        if meta.decode_part is not None:
            tokens, decode_meta = meta.decode_part
            out[tokens] = self.decode(q[tokens], k_cache, v_cache, decode_meta)
        slots, spans = meta.prefill_keys
        k, v = k_cache.index_select(0, slots), v_cache.index_select(0, slots)  # (sum of L, Hkv, D)
        for first, n_new, first_key, n_keys in spans:  # each chunk alone, unpadded: with Tq == Tk the backend
            keys = slice(first_key, first_key + n_keys)  # can take its causal fast path (SDPA's flash skips
            q_s = q[first:first + n_new].transpose(0, 1)[None]  # the masked half); (1, H, n_new, D)
            k_s, v_s = k[keys].transpose(0, 1)[None], v[keys].transpose(0, 1)[None]  # (1, Hkv, L, D)
            out[first:first + n_new] = attend(q_s, k_s, v_s, None)[0].transpose(0, 1)
        return out


class CompiledPagedAttention(PagedAttention):
    """`decode`: the reference through torch.compile, where the C++ kernel cannot be built. The batch size
    and the table width change every step: they are marked dynamic, so a handful of compiled kernels serve
    them all (heads, head size and block size stay constants the compiler can unroll and vectorise); the
    first steps compile them, and `serve` runs those steps in its warm-up (server/run.py)."""

    def __init__(self):
        self.compiled_decode = torch.compile(paged_decode_attention, dynamic=False)  # compiles on first call

    def decode(self, q, k_cache, v_cache, meta: PagedAttentionMetadata) -> torch.Tensor:
        for t, dims in ((q, (0,)), (meta.block_tables, (0, 1)), (meta.context_lens, (0,))):
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
        return self.compiled_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.block_size,
                                    1.0 / math.sqrt(q.shape[-1]))


class CpuPagedAttention(PagedAttention):
    """`decode`: the C++ kernel of paged_cpu.py (a pool in one of its KERNEL_DTYPES, the kernel built)."""

    def decode(self, q, k_cache, v_cache, meta: PagedAttentionMetadata) -> torch.Tensor:
        # the op itself, not paged_cpu's wrapper: one call from here to the kernel
        return torch.ops.mt_paged.decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                         meta.block_size, 1.0 / math.sqrt(q.shape[-1]))


def paged_attention_for(device: torch.device | str, dtype: torch.dtype, enforce_eager: bool = False) -> PagedAttention:
    """The paged attention for a pool of `dtype` on `device`, chosen once when the engine is built. On the
    CPU: the C++ kernel for fp32/bf16/fp16 pools where it builds; otherwise (float64, no compiler) the
    reference through torch.compile, or eagerly with `enforce_eager`. Elsewhere: the eager reference (a GPU
    engine on the `triton` backend takes triton_paged.TritonPagedAttention instead)."""
    if torch.device(device).type != "cpu":
        return PagedAttention()
    if dtype in KERNEL_DTYPES and decode_kernel_available():
        return CpuPagedAttention()
    return PagedAttention() if enforce_eager else CompiledPagedAttention()
