"""Prefill/decode disaggregation across servers: a server's `kv_role` (vLLM's names), through the KV store.

A router in vLLM's disaggregated mode (`vllm-router --vllm-pd-disaggregation`, vLLM's disagg proxy) sends
each request twice, under one X-Request-Id:

    1. to a prefill server (kv_role producer), with max_tokens=1, stream=false and
       kv_transfer_params={"do_remote_decode": true, ...}; it copies the kv_transfer_params of the answer
    2. to a decode server (kv_role consumer): the original request plus those kv_transfer_params

Here the KV moves through the shared KV store (engine/kv_connector.py) rather than NIXL's point to point
copies. The producer computes the prompt like any request (its connector saves every full block it
completes), waits until those saves have reached the store, then answers with kv_transfer_params that
say "the prompt is in the store, written by this model" (do_remote_prefill, remote_engine_id: the model's
fingerprint). The consumer, seeing them, waits a bounded time for the prompt's blocks to be in the store
before it queues the request; the scheduler's lookup then loads them like any stored block, and the
step computes only the last, partial block. Blocks that never come are recomputed: slower, still right.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from .metrics import ServerMetrics
from .protocol import ErrorResponse

ROLES = ("producer", "consumer")
POLL_S = 0.01  # a consumer asks the store again this often while blocks are in flight
SAVE_TIMEOUT_S = 30.0  # a producer answers anyway after this: the consumer then recomputes what is missing


@dataclass
class KVTransfer:
    """The role of one server (`serve --kv-role`) and its bound on waiting for blocks (`--kv-load-timeout`)."""

    role: str
    connector: object  # the engine's KVConnector
    metrics: ServerMetrics
    load_timeout_s: float = 1.0

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"kv_role={self.role!r} must be one of {', '.join(ROLES)}")
        if isinstance(self.load_timeout_s, bool) or not isinstance(self.load_timeout_s, int | float) \
                or not 0 <= self.load_timeout_s <= 600:
            raise ValueError(f"kv load timeout={self.load_timeout_s!r} must be a number of seconds in [0, 600]")
        self.engine_id = self.connector.fingerprint.hex()

    async def before_start(self, body, prompts: list[list[int]]) -> None:
        """A consumer given a producer's kv_transfer_params waits (bounded) for the prompts' blocks."""
        params = body.kv_transfer_params
        if params is None or self.role != "consumer":
            return
        if not isinstance(params, dict):
            raise ErrorResponse(400, "kv_transfer_params must be an object", param="kv_transfer_params")
        if params.get("do_remote_prefill") is not True or params.get("remote_engine_id") != self.engine_id:
            return  # nothing was prefilled for us, or by another model: its blocks could never match
        outcome = "loaded" if await self._wait_for_blocks(prompts) else "timed_out"
        self.metrics.kv_transfer_waits.labels(outcome).inc()

    async def _wait_for_blocks(self, prompts: list[list[int]]) -> bool:
        # the blocks the scheduler's lookup can use: inside the first len - 1 tokens (the last is computed)
        wanted = [(p, (len(p) - 1) // self.connector.block_size) for p in prompts]
        deadline = time.monotonic() + self.load_timeout_s
        while True:
            found = await asyncio.to_thread(
                lambda: all(self.connector.stored_run(p, n) == n for p, n in wanted))
            if found:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)

    async def after_finish(self) -> dict | None:
        """A producer: once every block it saved is in the store, the kv_transfer_params of its answer."""
        if self.role != "producer":
            return None
        saved = await asyncio.to_thread(self.connector.wait_saved, SAVE_TIMEOUT_S)
        self.metrics.kv_transfer_waits.labels("saved" if saved else "save_timed_out").inc()
        return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": self.engine_id,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}
