"""EngineConfig: every knob of the engine in one frozen dataclass, checked once when it is made.

    config = EngineConfig(block_size=16, max_num_seqs=64, max_num_batched_tokens=512)
    engine = LLMEngine(model, config)          # LLMEngine(model): the defaults

The pool's size is `num_blocks`, or as many blocks as fit in `kv_cache_bytes`, or (neither) a share of
memory; `pool_blocks` turns it into a block count once the engine knows the model (bytes per block).
`enforce_eager=True` runs every step eagerly: no CUDA graphs on a GPU, no torch.compile on the CPU (vLLM's
name for the same switch; the C++ paged decode kernel is no compiled graph and still runs).
`pack_linear_weights=True` (on the CPU at fp32) runs every nn.Linear through oneDNN with its weight
packed once (model/packed_linear.py), as vLLM's CPU backend does; False keeps `aten::mm`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .._checks import boolean, positive_int
from .block_manager import blocks_for


def default_kv_cache_bytes(device: torch.device) -> int:
    """A sensible share of memory for the pool: half the free GPU memory, or an eighth of the host's RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # blocks in the pool
    kv_cache_bytes: int | None = None  # or: as many blocks as fit in this many bytes
    max_num_seqs: int = 64  # running sequences at most
    max_num_batched_tokens: int = 512  # new tokens per step at most (decode tokens + prefill chunks)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs, no compiled decode attention
    pack_linear_weights: bool = True  # CPU fp32: the model's Linears read oneDNN-packed weights

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            positive_int(name, getattr(self, name))
        for name in ("num_blocks", "kv_cache_bytes"):  # None: the engine sizes the pool
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        for name in ("enable_prefix_caching", "enforce_eager", "pack_linear_weights"):
            boolean(name, getattr(self, name))

    def pool_blocks(self, block_bytes: int, max_seq_len: int, device: torch.device) -> int:
        """The pool's size in blocks of `block_bytes` bytes. With neither num_blocks nor kv_cache_bytes, a
        share of `device`'s memory, capped at what max_num_seqs full-length sequences could use."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_bytes is None:
            cap = self.max_num_seqs * blocks_for(max_seq_len, self.block_size)
            return max(1, min(cap, default_kv_cache_bytes(device) // block_bytes))
        num_blocks = self.kv_cache_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes} is smaller than one block "
                             f"({block_bytes} bytes at block_size={self.block_size})")
        return num_blocks
