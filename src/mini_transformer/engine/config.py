"""EngineConfig: every knob of the engine in one frozen dataclass, checked once when it is made.

    config = EngineConfig(block_size=16, max_num_seqs=64, max_num_batched_tokens=512)
    engine = LLMEngine(model, config)          # or LLMEngine(model, block_size=16, ...): the same thing

The pool's size is `num_blocks`, or as many blocks as fit in `kv_cache_bytes`, or (neither) a share of
memory; the engine turns it into a block count once it knows the model (bytes per block).
`enforce_eager=True` runs every step eagerly: no CUDA graphs on a GPU, no torch.compile on the CPU (vLLM's
name for the same switch; the C++ paged decode kernel is no compiled graph and still runs).
"""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import boolean, positive_int


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # blocks in the pool
    kv_cache_bytes: int | None = None  # or: as many blocks as fit in this many bytes
    max_num_seqs: int = 64  # running sequences at most
    max_num_batched_tokens: int = 512  # new tokens per step at most (decode tokens + prefill chunks)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs, no compiled decode attention

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            positive_int(name, getattr(self, name))
        for name in ("num_blocks", "kv_cache_bytes"):  # None: the engine sizes the pool
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        for name in ("enable_prefix_caching", "enforce_eager"):
            boolean(name, getattr(self, name))
