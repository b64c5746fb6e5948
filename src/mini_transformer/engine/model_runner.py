"""ModelRunner: the KV pool, and one forward pass over the packed tokens of every scheduled sequence.

The pool is ONE tensor for all layers, (2, n_layer, num_blocks * block_size, Hkv, D): k and v, then the
layer, then the slot. One block id therefore names the same slots in every layer, so the BlockManager
hands out a block once for the whole model, memory is claimed in one allocation, and each layer's part
is a view (`kv_cache[0, layer]`). Slots of one block are adjacent (slot = block_id * block_size + offset).

A step packs the new tokens of all scheduled sequences into ONE row, idx (1, N), with no padding, and
runs the same `TransformerLM` on it. The model sees a `PagedBatch` through the cache interface
(`begin` -> positions, `attend` -> write K/V through the slot mapping, then paged attention).
"""

from __future__ import annotations

import torch

from ..attention.paged import BLOCK_TABLE, GATHERED, PagedAttentionMetadata, paged_attention, write_kv
from ..config import TransformerConfig
from ..model.transformer import Attend, TransformerLM
from .sampler import PromptLogprobs, Sampler, read_back
from .sequence import Sequence


class PagedBatch:
    """The cache interface over the engine's pool, for one step. positions (1, N)."""

    def __init__(self, kv_cache: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata):
        self.kv_cache, self.positions, self.meta = kv_cache, positions, meta

    def begin(self, idx: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        assert attention_mask is None and idx.shape == self.positions.shape
        return self.positions  # (1, N): each token's position inside its own sequence

    def attend(self, layer: int, q, k, v, attend) -> torch.Tensor:
        """q (1, H, N, D); k, v (1, Hkv, N, D). Write every new token's K/V first, then attend: a sequence
        that shares a block filled in this same step reads it already written."""
        k_cache, v_cache = self.kv_cache[0, layer], self.kv_cache[1, layer]  # (num_slots, Hkv, D) views
        meta = self.meta
        write_kv(k_cache, v_cache, k[0].transpose(0, 1), v[0].transpose(0, 1), meta.slot_mapping)
        q = q[0].transpose(0, 1)  # (N, H, D)
        # meta holds the one layout the model's backend reads (ModelRunner checked the backend once)
        if meta.layouts == (BLOCK_TABLE,):  # the kernel walks the block tables itself: no gathered copy
            from ..attention.triton_paged import triton_paged_attention

            out = triton_paged_attention(q, k_cache, v_cache, meta.block_tables, meta.token_seq, meta.token_pos,
                                         meta.block_size)
        else:
            out = paged_attention(q, k_cache, v_cache, meta, attend)  # (N, H, D)
        return out.transpose(0, 1)[None]  # (1, H, N, D)


def attention_layout(backend: str) -> str:
    """Which metadata layout a backend's paged attention reads: the Triton kernel walks the block tables
    itself (BLOCK_TABLE); every other backend attends over keys gathered into padded groups (GATHERED)."""
    return BLOCK_TABLE if backend == "triton" else GATHERED


def bytes_per_block(cfg: TransformerConfig, block_size: int, dtype: torch.dtype) -> int:
    """2 (k and v) * n_layer * block_size * Hkv * D * bytes per element."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.n_layer * block_size * cfg.n_kv_heads * cfg.d_head * element


class ModelRunner:
    def __init__(self, model: TransformerLM, num_blocks: int, block_size: int):
        cfg = model.config
        weight = model.tok_emb.weight
        self.model, self.block_size = model, block_size
        # decided once: the metadata of every step is built in the one layout this backend reads
        self.attention_layout = attention_layout(cfg.attn_backend)
        assert all(m.backend == cfg.attn_backend for m in model.modules() if isinstance(m, Attend)), \
            "every layer must attend with the configured backend: the step metadata has its layout only"
        self.device, self.dtype = weight.device, weight.dtype
        shape = (2, cfg.n_layer, num_blocks * block_size, cfg.n_kv_heads, cfg.d_head)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.sampler = Sampler(cfg.vocab_size, self.device)

    def slots(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """(num_tokens,) the pool slots of a sequence's tokens 0 .. num_tokens-1, on the pool's device."""
        bs = self.block_size
        return torch.tensor([block_table[i // bs] * bs + i % bs for i in range(num_tokens)], device=self.device)

    # copy_kv_out / copy_kv_in move a whole prefix through its block table, all layers at once (a PD
    # handoff); paged.write_kv is the per-layer scatter of one step's new tokens through the slot mapping.
    def copy_kv_out(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """A copy of the K/V of a sequence's first num_tokens tokens: (2, n_layer, num_tokens, Hkv, D)."""
        return self.kv_cache[:, :, self.slots(block_table, num_tokens)].contiguous()  # dist.send needs contiguous

    def copy_kv_in(self, block_table: list[int], kv: torch.Tensor) -> None:
        """Put K/V (2, n_layer, P, Hkv, D) into the slots of a sequence's tokens 0 .. P-1."""
        self.kv_cache[:, :, self.slots(block_table, kv.shape[2])] = kv.to(self.device)

    def execute_model(self, scheduled: list[tuple[Sequence, int]]) -> list[int | None]:
        """One forward pass for the scheduled (sequence, num_new_tokens) pairs. Returns, per pair, the
        sampled next token, or None when the chunk does not reach the sequence's last token (its prefill
        goes on next step). The sampled ids (and the logprobs asked for) are read back to the host once,
        together; logprobs go onto their sequences (engine/sampler.py)."""
        input_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []  # row of the packed batch whose logits pick each sampling sequence's token
        samplers: list[Sequence] = []
        samples: list[bool] = []  # per pair: does this chunk reach the sequence's last token?
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            input_ids += seq.tokens_between(start, start + n)
            positions += range(start, start + n)
            samples.append(start + n == seq.num_tokens)
            if samples[-1]:
                last_rows.append(len(input_ids) - 1)
                samplers.append(seq)
        meta = PagedAttentionMetadata.build(
            [seq.block_table for seq, _ in scheduled], [seq.num_computed_tokens + n for seq, n in scheduled],
            [n for _, n in scheduled], self.block_size, self.device, layouts=(self.attention_layout,),
        )
        idx = torch.tensor([input_ids], dtype=torch.long, device=self.device)  # (1, N)
        batch = PagedBatch(self.kv_cache, torch.tensor([positions], device=self.device), meta)
        prompt = PromptLogprobs.of(scheduled)  # prompt rows get the head only when a request asks for them
        rows = torch.tensor(last_rows + prompt.rows, dtype=torch.long, device=idx.device)
        self.sampler.grammar.prepare(samplers)  # constrained rows: their masks fill on a worker during the forward
        logits, _ = self.model(idx, cache=batch, logits_at=rows, check=False)  # (1, M + R, V): those rows only
        M = len(last_rows)
        out = self.sampler.sample(logits[0, :M], samplers) if samplers else None
        if prompt.rows:
            prompt.compute(logits[0, M:])
        tokens = iter(read_back(out, samplers, prompt))  # the one host read
        return [next(tokens) if sampled else None for sampled in samples]
