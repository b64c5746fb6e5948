"""EngineSnapshot: a read-only picture of the engine between two steps, for whoever watches it.

`EngineStats` is the one place the engine's numbers are computed (counters, blocks in use, shared
blocks, bytes): `LLMEngine.stats()` is it as a dict, a snapshot carries it, the server's metrics read it.

A server's metrics and live page want the queues, each request's block table and the pool. They get
them from `LLMEngine.snapshot()`, taken on the engine's thread between two steps, so every number in one
snapshot belongs to the same moment; nothing in it points back into the engine (tuples and ints only), so it
can be read on any thread while the engine goes on stepping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType

from .block_manager import BlockManager
from .scheduler import EngineCounters, Scheduler
from .sequence import Sequence


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine started (the scheduler's EngineCounters), and the pool as it is now."""

    steps: int
    prefill_tokens_computed: int
    decode_tokens_computed: int
    prefix_cache_hit_tokens: int
    preemptions: int
    requests_finished: int
    requests_aborted: int
    requests_handed_off: int
    max_batched_tokens_seen: int
    mixed_steps: int  # steps with prefill chunks beside decode tokens
    kv_store_hit_tokens: int  # prompt tokens loaded from the KV connector's tiers
    num_blocks: int
    block_size: int
    blocks_in_use: int  # held by at least one request
    peak_blocks_in_use: int
    shared_blocks: int  # held by more than one request (a shared prefix)
    cached_blocks: int  # hold a prefix-cached full block
    kv_cache_bytes: int
    kv_bytes_in_use: int
    kv_bytes_holding_tokens: int  # of the blocks in use, the slots that hold a computed token
    num_waiting: int
    num_running: int
    kv_store: Mapping[str, int] = field(default_factory=dict)  # the KV connector's counters (none without one)

    @classmethod
    def of(cls, counters: EngineCounters, manager: BlockManager, scheduler: Scheduler, kv_cache_bytes: int,
           kv_store: Mapping[str, int] | None = None) -> EngineStats:
        block_bytes = kv_cache_bytes // manager.num_blocks
        return cls(**asdict(counters), kv_store=dict(kv_store or {}),
                   num_blocks=manager.num_blocks, block_size=manager.block_size,
                   blocks_in_use=manager.num_blocks_in_use, peak_blocks_in_use=manager.peak_blocks_in_use,
                   shared_blocks=manager.num_shared_blocks, cached_blocks=len(manager.hash_to_block_id),
                   kv_cache_bytes=kv_cache_bytes, kv_bytes_in_use=manager.num_blocks_in_use * block_bytes,
                   kv_bytes_holding_tokens=_slots_holding_tokens(scheduler, manager.block_size) * block_bytes
                   // manager.block_size,
                   num_waiting=len(scheduler.waiting), num_running=len(scheduler.running))

    def as_dict(self) -> dict:
        """Flat: the connector's counters come as kv_store_<name>."""
        flat = asdict(self)
        store = flat.pop("kv_store")
        return flat | {f"kv_store_{name}": value for name, value in store.items()}


def _slots_holding_tokens(scheduler: Scheduler, block_size: int) -> int:
    """Slots of in-use blocks that hold a computed token (a shared block counts once)."""
    filled: dict[int, int] = {}
    for seq in scheduler.running:
        for i, block_id in enumerate(seq.block_table):
            fill = min(block_size, max(0, seq.num_computed_tokens - i * block_size))
            filled[block_id] = max(filled.get(block_id, 0), fill)
    return sum(filled.values())


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
    attn_backend: str  # the attention backend the model runs (paged attention reads the pool with it)
    running: tuple[RequestSnapshot, ...]
    waiting: tuple[RequestSnapshot, ...]
    block_ref_counts: tuple[int, ...]
    block_cached: tuple[bool, ...]
    stats: Mapping[str, int]  # read-only: LLMEngine.stats() as it was (EngineStats as a mapping)
    block_tier: tuple[str, ...] = ()  # where each block's K/V came from; empty without a KV connector

    @classmethod
    def of(cls, scheduler: Scheduler, manager: BlockManager, stats: EngineStats, attn_backend: str,
           block_tier: tuple[str, ...] | None = None) -> EngineSnapshot:
        return cls(
            block_size=manager.block_size, num_blocks=manager.num_blocks, attn_backend=attn_backend,
            running=tuple(map(RequestSnapshot.of, scheduler.running)),
            waiting=tuple(map(RequestSnapshot.of, scheduler.waiting)),
            block_ref_counts=tuple(block.ref_count for block in manager.blocks),
            block_cached=tuple(block.block_hash is not None for block in manager.blocks),
            stats=MappingProxyType(stats.as_dict()),
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
        return self.stats["blocks_in_use"]

    @property
    def free_blocks(self) -> int:
        """Blocks no request holds (some still keep prefix-cached contents until they are reused)."""
        return self.num_blocks - self.blocks_in_use

    @property
    def shared_blocks(self) -> int:
        return self.stats["shared_blocks"]

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.stats["prefix_cache_hit_tokens"]

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of the prompt tokens admitted so far that came from the prefix cache, not computed."""
        hit, computed = self.stats["prefix_cache_hit_tokens"], self.stats["prefill_tokens_computed"]
        return hit / (hit + computed) if hit + computed else 0.0
