"""EngineSnapshot: a read-only picture of the engine between two steps, for whoever watches it.

A server's metrics and live page want the queues, each request's block table and the pool. They get
them from `LLMEngine.snapshot()`, taken under the engine's lock, so every number in one snapshot
belongs to the same moment; nothing in it points back into the engine (tuples and ints only), so it
can be read on any thread while the engine goes on stepping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .block_manager import BlockManager
from .scheduler import Scheduler
from .sequence import Sequence


@dataclass(frozen=True)
class RequestSnapshot:
    request_id: str
    status: str  # "running" or "waiting"
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    computed_tokens: int  # tokens whose K/V are in the pool
    cached_tokens: int  # prompt tokens found in the prefix cache at its last admission
    block_table: tuple[int, ...]

    @classmethod
    def of(cls, seq: Sequence) -> RequestSnapshot:
        return cls(seq.request_id, seq.status.value, seq.num_prompt_tokens, len(seq.output_token_ids),
                   seq.params.max_tokens, seq.num_computed_tokens, seq.num_cached_tokens, tuple(seq.block_table))


@dataclass(frozen=True)
class EngineSnapshot:
    """The queues (oldest first), the pool block by block, and the engine's `stats()` at the same moment.

    block_ref_counts[b]: how many requests hold block b (> 1: shared through the prefix cache).
    block_cached[b]: block b holds a prefix-cached full block (kept after its owners let go).
    block_tier[b]: the KV store tier block b's K/V were loaded from ("host", "redis"), "" if computed here.
    """

    block_size: int
    num_blocks: int
    running: tuple[RequestSnapshot, ...]
    waiting: tuple[RequestSnapshot, ...]
    block_ref_counts: tuple[int, ...]
    block_cached: tuple[bool, ...]
    stats: Mapping[str, int]  # read-only: LLMEngine.stats() as it was
    block_tier: tuple[str, ...] = ()  # empty without a KV connector

    @classmethod
    def of(cls, scheduler: Scheduler, manager: BlockManager, stats: dict,
           block_tier: tuple[str, ...] | None = None) -> EngineSnapshot:
        return cls(
            block_size=manager.block_size, num_blocks=manager.num_blocks,
            running=tuple(map(RequestSnapshot.of, scheduler.running)),
            waiting=tuple(map(RequestSnapshot.of, scheduler.waiting)),
            block_ref_counts=tuple(block.ref_count for block in manager.blocks),
            block_cached=tuple(block.block_hash is not None for block in manager.blocks),
            stats=MappingProxyType(dict(stats)),
            block_tier=block_tier or (),
        )

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks no request holds (some still keep prefix-cached contents until they are reused)."""
        return self.block_ref_counts.count(0)

    @property
    def shared_blocks(self) -> int:
        return sum(count > 1 for count in self.block_ref_counts)

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.stats["prefix_cache_hit_tokens"]

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of the prompt tokens admitted so far that came from the prefix cache, not computed."""
        hit, computed = self.stats["prefix_cache_hit_tokens"], self.stats["prefill_tokens_computed"]
        return hit / (hit + computed) if hit + computed else 0.0
