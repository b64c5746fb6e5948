"""The decoders generate() drives: each runs the model for a prompt, then for one new token per row.

Every decoder answers two calls, so generate's loop is the same for all of them:

    logits = decoder.prefill(idx, attention_mask)   # prompt (B, T) -> logits after its last token (B, V)
    logits = decoder.step(next_ids)                 # new tokens (B,) -> logits after them (B, V)

  * `CachedDecoder`: a `KVCache`; prefill fills it, each step adds one slot (the learner's version);
  * `RecomputeDecoder`: no cache, every step runs the whole sequence again (the O(T^2) reference that
    checks the cache, `use_cache=False`);
  * `static_cache.CompiledDecoder`: a fixed-shape cache and a step compiled once (`compile=True`).

The model is called through `TransformerLM.logits`: generate checked the inputs at its door.
"""

from __future__ import annotations

import torch

from ..model.transformer import TransformerLM
from .kv_cache import KVCache


def prefill(model: TransformerLM, idx: torch.Tensor, cache, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Run the whole prompt (B, T) once, filling the cache. Returns the last position's logits (B, V)."""
    last = torch.tensor([-1], device=idx.device)
    return model.logits(idx, attention_mask=attention_mask, cache=cache, logits_at=last)[:, -1]  # (B, 1, V) -> (B, V)


def decode_step(model: TransformerLM, token: torch.Tensor, cache) -> torch.Tensor:
    """Run one new token per row (B,) against the cached keys/values. Returns its logits (B, V)."""
    return model.logits(token[:, None], cache=cache)[:, -1]  # (B, 1, V) -> (B, V)


class CachedDecoder:
    """Prefill into a `KVCache` of batch_size rows and max_len slots, then one eager step per token."""

    def __init__(self, model: TransformerLM, batch_size: int, max_len: int, device: torch.device):
        self.model = model
        self.cache = KVCache.for_model(model, batch_size, max_len, dtype=model.tok_emb.weight.dtype, device=device)

    def prefill(self, idx: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return prefill(self.model, idx, self.cache, attention_mask)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        return decode_step(self.model, token, self.cache)


class RecomputeDecoder:
    """No cache: each step runs the prompt and every token so far again, to read one new row of logits."""

    def __init__(self, model: TransformerLM):
        self.model = model

    def prefill(self, idx: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        self.tokens, self.attention_mask = idx, attention_mask  # (B, T), grown by one column per step
        return self.model.logits(idx, attention_mask=attention_mask)[:, -1]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        self.tokens = torch.cat([self.tokens, token[:, None]], dim=1)  # (B, T + 1)
        if self.attention_mask is not None:  # the new token is real in every row
            real = torch.ones_like(self.attention_mask[:, :1])
            self.attention_mask = torch.cat([self.attention_mask, real], dim=1)
        return self.model.logits(self.tokens, attention_mask=self.attention_mask)[:, -1]
