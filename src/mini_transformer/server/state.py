"""A read-only view of the engine for /v1/engine/state, /metrics and the live page.

The engine hands out a frozen `EngineSnapshot` (LLMEngine.snapshot(): the queues, each request's block
table, the pool block by block, its stats, all taken under the engine's lock at one moment); this file
turns it into plain JSON-able data. The pool goes out as flat arrays (one entry per block) to stay small
with thousands of blocks; each request carries its block table, so the page can colour a block by its
owner.
"""

from __future__ import annotations

from ..engine import EngineSnapshot, RequestSnapshot


def _request_view(request: RequestSnapshot, handle) -> dict:
    return {
        "request_id": request.request_id,
        "status": request.status,
        "prompt_tokens": request.prompt_tokens,
        "output_tokens": request.output_tokens,
        "max_tokens": request.max_tokens,
        "computed_tokens": request.computed_tokens,
        "cached_tokens": request.cached_tokens,
        "block_table": list(request.block_table),
        "choice": None if handle is None else handle.index,
    }


def engine_state(snapshot: EngineSnapshot, handles: dict) -> dict:
    """Queues, each request's block table, and the pool: per block its reference count (> 1: shared by
    several requests) and whether it holds a prefix-cached block (kept after its owners left); with a
    KV store, the tier each block was loaded from ("" computed here) and the store's counters."""
    stats = snapshot.stats
    return {
        "block_size": snapshot.block_size,
        "attn_backend": snapshot.attn_backend,
        "num_blocks": snapshot.num_blocks,
        "blocks_in_use": snapshot.blocks_in_use,
        "shared_blocks": snapshot.shared_blocks,
        "running": [_request_view(r, handles.get(r.request_id)) for r in snapshot.running],
        "waiting": [_request_view(r, handles.get(r.request_id)) for r in snapshot.waiting],
        "pool": {
            "ref_count": list(snapshot.block_ref_counts),
            "cached": [int(cached) for cached in snapshot.block_cached],
            "tier": list(snapshot.block_tier),
        },
        "kv_store": {k.removeprefix("kv_store_"): v for k, v in stats.items() if k.startswith("kv_store_")},
    }
