"""The contiguous KV cache of generate(): one slab of keys and one of values per layer.

It answers the model's two calls (`begin`, `attend`: model/cache.py) with a (B, Hkv, max_len, D) slab
per layer, written by position. `SlabCache` holds what KVCache shares with static_cache.py's StaticCache:
the check of the sizes and `for_model`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Self

import torch

from .._checks import positive_int
from ..config import TransformerConfig
from ..model.cache import AttendFn

if TYPE_CHECKING:
    from ..model.transformer import TransformerLM


class SlabCache:
    """What the two slab caches share (KVCache here, StaticCache in static_cache.py): the check of their
    sizes and `for_model`. Each lays out its own slabs; both take (n_layer, batch_size, max_len,
    n_kv_heads, d_head) and the dtype and device of the slabs."""

    @staticmethod
    def check_sizes(**sizes: int) -> None:
        """The constructors' door: each size is a positive integer (`_checks.positive_int`)."""
        for name, value in sizes.items():
            positive_int(name, value)

    @classmethod
    def for_model(cls, model: TransformerLM | TransformerConfig, batch_size: int, max_len: int | None = None, *,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Self:
        """A cache shaped for `model` (a TransformerLM, or a TransformerConfig): batch_size rows of max_len
        slots (default: max_seq_len). A model's layers say how many K/V heads they hold (`kv_heads`: a
        tensor-parallel shard holds its share of the config's n_kv_heads)."""
        cfg, n_kv_heads = (model, model.n_kv_heads) if isinstance(model, TransformerConfig) else (model.config,
                                                                                                model.kv_heads)
        max_len = cfg.max_seq_len if max_len is None else max_len
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len={max_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
        return cls(cfg.n_layer, batch_size, max_len, n_kv_heads, cfg.d_head, dtype=dtype, device=device)


class KVCache(SlabCache):
    """A preallocated cache: one (B, Hkv, max_len, D) slab of keys and one of values per layer.

    Rows of a batch are left-padded, so every row has the same number of written slots (`length`);
    `key_padding_mask` remembers which slots hold real tokens and `next_position` how many real tokens
    each row has seen (the position id of its next token). `has_padding` stays False until a padded
    batch is written; until then attention gets no mask at all (a single decode query sees every key).
    """

    def __init__(self, n_layer: int, batch_size: int, max_len: int, n_kv_heads: int, d_head: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.check_sizes(n_layer=n_layer, batch_size=batch_size, max_len=max_len, n_kv_heads=n_kv_heads,
                         d_head=d_head)
        shape = (n_layer, batch_size, n_kv_heads, max_len, d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.key_padding_mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.start = self.length = 0  # the slots [start, length) hold the tokens of the current pass
        self.has_padding = False  # a Python flag, so that deciding "no mask needed" never syncs a device

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """2 (k and v) * n_layer * B * Hkv * max_len * D * bytes per element."""
        return self.k.nbytes + self.v.nbytes

    def check_fits(self, model: TransformerLM, batch_size: int, n_new: int, dtype: torch.dtype) -> None:
        """Raise ValueError unless this cache can take `n_new` tokens of `model` running in `dtype`.
        The model's door calls it when a user hands in a cache."""
        n_layer, B, Hkv, max_len, D = self.k.shape
        cfg = model.config
        if (n_layer, Hkv, D) != (cfg.n_layer, model.kv_heads, cfg.d_head):
            raise ValueError(
                f"cache has (n_layer, n_kv_heads, d_head) = {(n_layer, Hkv, D)}, expected "
                f"{(cfg.n_layer, model.kv_heads, cfg.d_head)} from the model"
            )
        if B != batch_size:
            raise ValueError(f"batch size {batch_size} does not match the cache's batch_size={B}")
        if self.k.dtype != dtype:
            raise ValueError(f"cache dtype {self.k.dtype} does not match the model's dtype {dtype}")
        if self.length + n_new > max_len:
            raise ValueError(f"cache overflow: {self.length} cached + {n_new} new tokens > max_len={max_len}")

    def reset(self) -> None:
        """Forget everything (the slabs are kept and overwritten): ready for a new batch of prompts."""
        self.key_padding_mask.zero_()
        self.next_position.zero_()
        self.start = self.length = 0
        self.has_padding = False

    def begin(self, idx: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Reserve the next T slots for the new tokens idx (B, T); attention_mask (B, T), 1 = real token,
        None = all real. Returns their position ids (B, T)."""
        T = idx.shape[1]
        self.start, self.length = self.length, self.length + T
        new_slots = self.key_padding_mask[:, self.start:self.length]  # (B, T) view
        if attention_mask is None:
            new_slots.fill_(True)
            positions = self.next_position[:, None] + torch.arange(T, device=idx.device)  # (B, T)
            self.next_position += T
            return positions
        keep = attention_mask.bool()  # (B, T)
        new_slots.copy_(keep)
        self.has_padding = True
        positions = (self.next_position[:, None] + keep.cumsum(dim=-1) - 1).clamp(min=0)  # (B, T)
        self.next_position += keep.sum(dim=-1)
        return positions

    def attend(self, layer, q, k, v, attend: AttendFn) -> torch.Tensor:
        """Write this layer's new keys/values (B, Hkv, T, D) into their slots, then attend over every
        slot written so far (B, Hkv, length, D)."""
        k_all, v_all = self.k[layer, :, :, :self.length], self.v[layer, :, :, :self.length]  # views
        k_all[:, :, self.start:].copy_(k)
        v_all[:, :, self.start:].copy_(v)
        key_padding_mask = self.key_padding_mask[:, :self.length] if self.has_padding else None
        return attend(q, k_all, v_all, key_padding_mask)

    def rollback(self, n: int) -> None:
        """Forget the last n written slots (draft tokens the target rejected, in speculative decoding).
        Their keys and values stay in the slabs, unread, until the next tokens overwrite them."""
        assert 0 <= n <= self.length, f"cannot roll back {n} of {self.length} slots"
        if n == 0:
            return
        dropped = self.key_padding_mask[:, self.length - n:self.length]  # (B, n) view
        self.next_position -= dropped.sum(dim=-1)
        dropped.fill_(False)
        self.start = self.length = self.length - n
