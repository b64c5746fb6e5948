"""PagedBatch: the model's cache interface (model/cache.py) over the engine's KV pool, for one step.

The model calls `begin` once and `attend` once per layer. `attend` writes the layer's new K/V through the
slot mapping, then calls the engine's paged attention (attention/paged.py), chosen once when the runner
was built: `decode` for a decode-only step, `prefill` for a step with prefill rows. So a layer reaches its
kernel in two calls, as in nano-vllm's `Attention.forward`.
"""

from __future__ import annotations

import torch

from ..attention.paged import PagedAttention, PagedAttentionMetadata, write_kv
from ..model.cache import AttendFn


class PagedBatch:
    """One step's tokens packed into one row: positions (1, N); kv_cache the runner's pool
    (2, n_layer, num_slots, Hkv, D); meta the step's attention metadata; attention the runner's backend."""

    def __init__(self, kv_cache: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata,
                 attention: PagedAttention):
        self.kv_cache, self.positions, self.meta, self.attention = kv_cache, positions, meta, attention

    def begin(self, idx: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        assert attention_mask is None and idx.shape == self.positions.shape
        return self.positions  # (1, N): each token's position inside its own sequence

    def attend(self, layer: int, q, k, v, attend: AttendFn) -> torch.Tensor:
        """q (1, H, N, D); k, v (1, Hkv, N, D). Write every new token's K/V first, then attend: a sequence
        that shares a block filled in this same step reads it already written."""
        k_cache, v_cache = self.kv_cache[0, layer], self.kv_cache[1, layer]  # (num_slots, Hkv, D) views
        write_kv(k_cache, v_cache, k[0].transpose(0, 1), v[0].transpose(0, 1), self.meta.slot_mapping)
        q = q[0].transpose(0, 1)  # (N, H, D)
        if self.meta.is_decode_only:  # the common step: one query per sequence, in sequence order
            out = self.attention.decode(q, k_cache, v_cache, self.meta)
        else:
            out = self.attention.prefill(q, k_cache, v_cache, self.meta, attend)
        return out.transpose(0, 1)[None]  # (1, H, N, D)
