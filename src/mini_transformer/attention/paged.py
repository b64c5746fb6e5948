"""Paged attention: the queries of many sequences against keys and values kept in a pool of blocks.

The serving engine keeps K/V in a pool of slots, `block_size` slots per block. A sequence owns a list of
blocks, its block table; the key at position p of that sequence lives in slot

    slot = block_table[p // block_size] * block_size + p % block_size

One step of the engine packs the new tokens of every scheduled sequence into one row (N tokens, no
padding). Each sequence contributes `query_len` new tokens that are the END of its `context_len` keys
(a decode step: 1 of L; a prefill chunk or a prefix-cache hit: a suffix; a whole prompt: all of them).

The step's inputs are four tensors with flash-attn's varlen names, built once per step on the host and
copied to the device in ONE copy (pinned memory, non_blocking on CUDA):

    slot_mapping (N,)       where each new token's K/V is written
    block_tables (S, Bmax)  each sequence's block ids (rows padded with block 0)
    context_lens (S,)       each sequence's keys after this step (cached + new)
    query_start_loc (S+1,)  sequence s owns packed tokens query_start_loc[s] .. query_start_loc[s+1]-1

Two ways to attend, one per kind of row, both reading only those fields:
  decode rows (1 query): `paged_decode_attention` is the readable reference (it gathers when run
      eagerly). The engine runs, on the CPU, the C++ kernel of `paged_cpu.py`: per (sequence, kv head)
      it walks the block table with an online softmax, no gathered copy, no padding (the FlashAttention
      idea of stage 4 applied to pages); where it cannot be built, the reference through torch.compile
      (inductor turns the `[block_tables]` indexing into loads inside the reductions).
      `triton_paged.py` is the same on a GPU.
  prefill rows (a chunk of queries): their keys gathered (one index_select for all of them), then each
      sequence's chunk through the ordinary contiguous backend, unpadded (queries sit at the end of the
      keys, so no new mask logic; a whole prompt takes the backend's causal fast path). This copy pays
      where many queries share each key.

    meta = PagedAttentionMetadata.build(block_tables, context_lens, query_lens, block_size, device)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)     # the new tokens' K/V into their slots
    out = paged_attention(q, k_cache, v_cache, meta, decode=decode_attention_for("cpu"))  # (N, H, D)

Shapes: q (N, H, D) packed; k, v (N, Hkv, D); k_cache, v_cache (num_slots, Hkv, D) for one layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .naive import naive_attention
from .paged_cpu import KERNEL_DTYPES, decode_kernel_available, paged_decode_kernel

__all__ = ["PagedAttentionMetadata", "decode_attention_for", "paged_attention", "paged_decode_attention", "write_kv"]


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
    _cache: dict = field(default_factory=dict, repr=False)  # index tensors derived on first use

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

    def index(self, name: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """An index tensor derived from the fields, made on first use in this step, reused by every layer."""
        if name not in self._cache:
            self._cache[name] = make()
        return self._cache[name]


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


_compiled_decode = None


def compiled_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size: int, scale: float):
    """paged_decode_attention through torch.compile. The batch size and the table width change every step:
    they are marked dynamic, so a handful of compiled kernels serve them all (heads, head size and block
    size stay constants the compiler can unroll and vectorise). Measured with TORCH_LOGS=recompiles on a
    mixed workload: 5 compiles (size 1 specialised, and the q stride / table offset of mixed prefill +
    decode steps), all in the first steps; `serve` runs them in its warm-up (server/run.py)."""
    global _compiled_decode
    if _compiled_decode is None:
        _compiled_decode = torch.compile(paged_decode_attention, dynamic=False)
    for t, dims in ((q, (0,)), (block_tables, (0, 1)), (context_lens, (0,))):
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)
    return _compiled_decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)


def decode_attention_for(device: torch.device | str, enforce_eager: bool = False) -> Callable:
    """The decode rows' attention the engine runs on `device`, chosen once. On the CPU: the C++ kernel
    (paged_cpu.py) where it builds, for fp32/bf16/fp16 pools (float64 runs the reference); where it cannot
    be built, the reference through torch.compile, or eagerly with `enforce_eager`. Elsewhere: the eager
    reference (a GPU engine on the `triton` backend uses triton_paged.py instead)."""
    if torch.device(device).type != "cpu":
        return paged_decode_attention
    fallback = paged_decode_attention if enforce_eager else compiled_decode_attention
    if not decode_kernel_available():
        return fallback

    def kernel_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size: int, scale: float):
        run = paged_decode_kernel if q.dtype in KERNEL_DTYPES else fallback
        return run(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)

    return kernel_decode_attention


def _naive(q, k, v, key_padding_mask):
    return naive_attention(q, k, v, causal=True, key_padding_mask=key_padding_mask, dropout_p=0.0,
                           scale=1.0 / math.sqrt(q.shape[-1]))


def _prefill_keys(meta: PagedAttentionMetadata, seqs: list[int]):
    """For the prefill rows' sequences: the pool slots of all their keys, one sequence after another
    (sum of their context_lens,), derived on the device from the block tables; and, from the host's
    lengths, per sequence (first packed query, queries, first of its keys in that list, keys)."""
    n_keys = np.array([meta.context_lens_host[s] for s in seqs])
    key_start = np.cumsum(n_keys) - n_keys
    owner = np.repeat(np.asarray(seqs), n_keys)  # each key's sequence
    position = np.arange(n_keys.sum()) - np.repeat(key_start, n_keys)  # each key's position in it
    both = torch.from_numpy(np.stack([owner, position])).to(meta.slot_mapping.device, non_blocking=True)
    owner_t, position_t = both
    bs = meta.block_size
    slots = meta.block_tables[owner_t, position_t // bs] * bs + position_t % bs
    query_start = np.concatenate([[0], np.cumsum(meta.query_lens)])
    spans = [(int(query_start[s]), meta.query_lens[s], int(k0), int(n))
             for s, k0, n in zip(seqs, key_start, n_keys, strict=True)]
    return slots, spans


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
    decode: Callable = paged_decode_attention,
) -> torch.Tensor:
    """Causal attention of the packed queries q (N, H, D) over each sequence's keys in the pool.

    Decode rows: `decode`, paged_decode_attention's signature (default: that reference itself; the engine
    passes decode_attention_for(device): the C++ kernel on the CPU). Prefill rows: their keys
    gathered, then per sequence `attend(q, k, v, key_padding_mask=None)`, a contiguous causal attention with
    queries at the end of the keys (default: the naive reference; the model passes its own `Attend`, so the configured
    backend runs). Returns (N, H, D) in the order of q."""
    attend = attend or _naive
    N, H, D = q.shape
    scale = 1.0 / math.sqrt(D)
    if meta.is_decode_only:  # the common step: every row is one token, already in sequence order
        return decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.block_size, scale)
    out = q.new_empty(N, H, D)
    decode_seqs = meta.rows(decode=True)
    if decode_seqs:
        rows = meta.index("decode_rows", lambda: torch.tensor(decode_seqs, device=q.device))
        tokens = meta.index("decode_tokens", lambda: meta.query_start_loc[rows])
        out[tokens] = decode(q[tokens], k_cache, v_cache, meta.block_tables[rows], meta.context_lens[rows],
                             meta.block_size, scale)
    slots, spans = meta.index("prefill", lambda: _prefill_keys(meta, meta.rows(decode=False)))
    k, v = k_cache.index_select(0, slots), v_cache.index_select(0, slots)  # (sum of L, Hkv, D)
    for first, n_new, first_key, n_keys in spans:  # each chunk alone, unpadded: with Tq == Tk the backend
        keys = slice(first_key, first_key + n_keys)  # can take its causal fast path (SDPA's flash skips
        q_s = q[first:first + n_new].transpose(0, 1)[None]  # the masked half); (1, H, n_new, D)
        k_s, v_s = k[keys].transpose(0, 1)[None], v[keys].transpose(0, 1)[None]  # (1, Hkv, L, D)
        out[first:first + n_new] = attend(q_s, k_s, v_s, None)[0].transpose(0, 1)
    return out
