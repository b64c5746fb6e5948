"""A preallocated key/value cache: one (B, Hkv, max_len, D) slab per layer, written by position.

Rows of a batch are left-padded, so every row has the same number of written slots (`length`);
`keep` remembers which slots hold real tokens and `next_position` how many real tokens each row
has seen (the position id of its next token). `has_padding` stays False until a padded batch is
written, and until then attention gets no mask at all (a single decode query sees every key).
"""

from __future__ import annotations

import torch

from .config import TransformerConfig


class KVCache:
    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        max_len: int,
        n_kv_heads: int,
        d_head: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        for name, value in (("n_layer", n_layer), ("batch_size", batch_size), ("max_len", max_len),
                            ("n_kv_heads", n_kv_heads), ("d_head", d_head)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        shape = (n_layer, batch_size, n_kv_heads, max_len, d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.keep = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = 0
        self.has_padding = False  # a Python flag, so that deciding "no mask needed" never syncs a device

    @classmethod
    def for_model(cls, cfg: TransformerConfig, batch_size: int, max_len: int | None = None, *,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> KVCache:
        max_len = cfg.max_seq_len if max_len is None else max_len
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len={max_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
        return cls(cfg.n_layer, batch_size, max_len, cfg.n_kv_heads, cfg.d_head, dtype=dtype, device=device)

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

    @property
    def row_lengths(self) -> torch.Tensor:
        """(B,) number of real (non-padding) tokens cached per row."""
        return self.next_position.clone()

    def check_fits(self, cfg: TransformerConfig, batch_size: int, n_new: int, dtype: torch.dtype) -> None:
        """Raise ValueError if this cache cannot take `n_new` tokens of a model with config `cfg`
        running in `dtype` (called by the model before any work)."""
        _, B, Hkv, max_len, D = self.k.shape
        if (self.k.shape[0], Hkv, D) != (cfg.n_layer, cfg.n_kv_heads, cfg.d_head):
            raise ValueError(
                f"cache has (n_layer, n_kv_heads, d_head) = {(self.k.shape[0], Hkv, D)}, expected "
                f"{(cfg.n_layer, cfg.n_kv_heads, cfg.d_head)} from the model's config"
            )
        if B != batch_size:
            raise ValueError(f"batch size {batch_size} does not match the cache's batch_size={B}")
        if self.k.dtype != dtype:
            raise ValueError(f"cache dtype {self.k.dtype} does not match the model's dtype {dtype}")
        if self.length + n_new > max_len:
            raise ValueError(f"cache overflow: {self.length} cached + {n_new} new tokens > max_len={max_len}")

    def reset(self) -> None:
        """Forget everything (the slabs are kept and overwritten): ready for a new batch of prompts."""
        self.keep.zero_()
        self.next_position.zero_()
        self.length = 0
        self.has_padding = False

    def prepare(self, keep_new: torch.Tensor, *, padded: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Reserve slots for T new tokens. keep_new (B, T) bool, True = real token; `padded=False`
        promises that keep_new is all True (the caller knows it without looking at the tensor).

        Returns the key padding mask for all keys so far (B, length + T), or None while no slot ever
        held padding (lets attention skip the mask), and the new tokens' position ids (B, T).
        Call `advance(keep_new)` once every layer has called `update`.
        """
        B, T = keep_new.shape
        if B != self.batch_size:
            raise ValueError(f"batch size {B} does not match the cache's batch_size={self.batch_size}")
        if self.length + T > self.max_len:
            raise ValueError(
                f"cache overflow: {self.length} cached + {T} new tokens > max_len={self.max_len}"
            )
        end = self.length + T
        self.keep[:, self.length:end] = keep_new
        position_ids = (self.next_position[:, None] + keep_new.cumsum(dim=-1) - 1).clamp(min=0)  # (B, T)
        self.has_padding = self.has_padding or padded
        return (self.keep[:, :end] if self.has_padding else None), position_ids

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new keys/values (B, Hkv, T, D); return all keys/values (B, Hkv, length + T, D)."""
        end = self.length + k_new.shape[2]
        k_all, v_all = self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # views into the slabs
        k_all[:, :, self.length:].copy_(k_new)
        v_all[:, :, self.length:].copy_(v_new)
        return k_all, v_all

    def advance(self, keep_new: torch.Tensor) -> None:
        self.length += keep_new.shape[1]
        self.next_position += keep_new.sum(dim=-1)
