"""Exercise (docs/03): the KV cache's two calls, and one decode step.

Fill in `KVCache.begin`, `KVCache.attend` and `decode_step`, then grade them:

    uv run pytest exercises/test_ex03_kv_cache.py

The model asks any cache two things on every forward pass (the `Cache` protocol in src/mini_transformer/model/cache.py):

    positions = cache.begin(idx, attention_mask)   # once: reserve slots for the new tokens, return their positions
    out = cache.attend(layer, q, k, v, attend)     # per layer: store k, v; attend over every slot so far

The grader runs the project's real `TransformerLM` with your cache and checks that every decode step gives
the same logits as recomputing the whole sequence.
"""

from __future__ import annotations

import torch


class KVCache:
    """One (B, Hkv, max_len, D) slab of keys and one of values per layer, written by position."""

    def __init__(self, n_layer: int, batch_size: int, max_len: int, n_kv_heads: int, d_head: int, *,
                 dtype: torch.dtype = torch.float32):
        shape = (n_layer, batch_size, n_kv_heads, max_len, d_head)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.key_padding_mask = torch.zeros(batch_size, max_len, dtype=torch.bool)  # True = a real token
        self.next_position = torch.zeros(batch_size, dtype=torch.long)  # real tokens seen per row
        self.start = self.length = 0  # the slots [start, length) belong to the current forward pass

    def begin(self, idx: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """idx (B, T) new tokens; attention_mask (B, T) with 1 = real, 0 = left padding, or None (all real).

        Reserve the next T slots, remember which of them hold real tokens, and return the position ids
        (B, T): a row's real tokens are numbered on from its next_position, padding does not count (give
        padded slots any position >= 0; their keys are masked anyway).
        """
        # TODO 1: this pass owns the T slots right after the ones already filled
        # TODO 2: record which of those slots hold real tokens
        # TODO 3: number each row's real tokens on from where that row stopped (padding takes no number of
        #         its own), and move every row's next_position past its real tokens
        raise NotImplementedError("TODO: exercise ex03_kv_cache, KVCache.begin")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend) -> torch.Tensor:
        """q (B, H, T, D); k, v (B, Hkv, T, D): this layer's new keys and values.

        Write k and v into slots [start, length) of layer `layer`, then return
        attend(q, all keys so far, all values so far, key_padding_mask of those slots): (B, H, T, D).
        """
        # TODO 4: store this layer's new keys and values in this pass's slots
        # TODO 5: attend over every slot written so far (none of the empty ones), with its padding mask
        raise NotImplementedError("TODO: exercise ex03_kv_cache, KVCache.attend")


def decode_step(model, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """token (B,) one new token per row -> its logits (B, V), extending the cache by one slot.

    Call `model.logits` (the model without the checks of its door, which accepts only its own KVCache
    class) on a (B, 1) input with cache=cache and keep the last position's logits.
    """
    # TODO 6
    raise NotImplementedError("TODO: exercise ex03_kv_cache, decode_step")
