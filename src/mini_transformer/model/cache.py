"""What the model asks of a cache: two calls, and nothing more.

For each forward pass the model asks

    positions = cache.begin(idx, attention_mask)       # (B, T) position ids of the new tokens
    out = cache.attend(layer, q, k, v, attend)         # per layer: keep k, v; attend over what each query may see

`NoCache` (here) is a forward pass over whole sequences (training, a full recompute): the keys are the
new tokens themselves. The caches that keep keys live with their users: `KVCache` (inference/kv_cache.py)
for generate(), `StaticCache` (inference/static_cache.py) for the compiled decode step, and the serving
engine's `PagedBatch` (engine/paged_batch.py). So one model runs all of them, and the model never
imports the code that uses it.

`attend(q, k, v, key_padding_mask)` (an `AttendFn`) is the model's attention, the layer's `Attend` module
(its backend, causal, queries at the end of the keys); key_padding_mask (B, Tk) bool, True = a real key,
or None when no key is padding. KVCache and StaticCache call it; the engine's PagedBatch calls its paged
attention object instead (which calls `attend` for prefill chunks). Either way a layer reaches its kernel
in two calls: `cache.attend`, then the attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@runtime_checkable
class Cache(Protocol):
    def begin(self, idx: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attend: AttendFn) -> torch.Tensor: ...


class NoCache:
    """Whole sequences, nothing kept: keys and values are the new tokens' own."""

    key_padding_mask: torch.Tensor | None = None

    def begin(self, idx: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        B, T = idx.shape
        if attention_mask is None:  # nothing to mask but the future: lets backends take fast paths
            return torch.arange(T, device=idx.device).expand(B, T)  # (B, T)
        self.key_padding_mask = attention_mask.bool()  # (B, T)
        # a left-padded row starts at position 0 at its first real token
        return (self.key_padding_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (B, T)

    def attend(self, layer, q, k, v, attend: AttendFn) -> torch.Tensor:
        return attend(q, k, v, self.key_padding_mask)



@runtime_checkable
class CheckedCache(Cache, Protocol):
    """A cache a user hands to `forward` directly (KVCache): the model's door asks it whether the new
    tokens fit, and how many it holds already (`length`), before anything is written."""

    length: int

    def check_fits(self, model, batch_size: int, n_new: int, dtype: torch.dtype) -> None: ...
