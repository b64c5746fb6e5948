"""A read-only view of the engine for /v1/engine/state, /metrics and the live page.

The engine exposes its scheduler (running list, waiting queue) and block manager (the pool); this file
reads them and writes plain JSON-able data. It runs on the engine thread only, between steps, so what it
reads is consistent. The pool goes out as flat arrays (one entry per block) to stay small with thousands
of blocks; each request carries its block table, so the page can colour a block by its owner.
"""

from __future__ import annotations


def engine_counts(engine) -> tuple[int, int]:
    """(running, waiting) requests."""
    scheduler = engine.scheduler
    return len(scheduler.running), len(scheduler.waiting)


def _request_view(seq, handle) -> dict:
    return {
        "request_id": seq.request_id,
        "status": seq.status.value,
        "prompt_tokens": seq.num_prompt_tokens,
        "output_tokens": len(seq.output_token_ids),
        "max_tokens": seq.params.max_tokens,
        "computed_tokens": seq.num_computed_tokens,
        "cached_tokens": seq.num_cached_tokens,
        "block_table": list(seq.block_table),
        "choice": None if handle is None else handle.index,
    }


def engine_state(engine, handles: dict) -> dict:
    """Queues, each request's block table, and the pool: per block its reference count (> 1: shared by
    several requests) and whether it holds a prefix-cached block (kept after its owners left)."""
    scheduler = engine.scheduler
    manager = scheduler.block_manager
    return {
        "block_size": manager.block_size,
        "num_blocks": manager.num_blocks,
        "blocks_in_use": manager.num_blocks_in_use,
        "shared_blocks": manager.num_shared_blocks,
        "running": [_request_view(s, handles.get(s.request_id)) for s in scheduler.running],
        "waiting": [_request_view(s, handles.get(s.request_id)) for s in scheduler.waiting],
        "pool": {
            "ref_count": [b.ref_count for b in manager.blocks],
            "cached": [int(b.block_hash is not None) for b in manager.blocks],
        },
    }
