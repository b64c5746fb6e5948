"""KV events: what the prefix cache holds, published for a KV-aware router in vLLM's wire format.

A router in front of several replicas sends a prompt to the one that already holds its prefix only if
it knows what each pool holds. The block manager notes every change of its prefix cache (a full block
entered, a block evicted, a reset); after each engine step the engine hands those notes here as one
batch, and a background thread publishes it on a ZeroMQ PUB socket, as vLLM's `KVEventsConfig`
publisher does (vllm/distributed/kv_events.py):

    frames   [topic, seq (8 bytes, big-endian), payload]
    payload  msgpack [ts, [event, ...]]                                        (EventBatch, array-like)
    event    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
              "token_ids": [...], "block_size": B, "lora_id": None, "medium": "GPU", "lora_name": None}
             {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}
             {"type": "AllBlocksCleared"}

The router does not trust our hash function: it hashes the token ids of each stored block itself and
uses our hashes only as names (to chain a block to its parent and to find it again when it is removed),
then matches a request by tokenising its prompt (through the replica's own /tokenize). So a hash needs
only to be stable and unsigned on the wire: Python's int hash, taken modulo 2**64.

The engine thread never waits here: a batch goes into a bounded queue, and when the queue is full it is
dropped and counted. Its sequence number is still used up, so a subscriber sees the gap. The last
batches are kept for replay: a subscriber that missed some asks a ROUTER socket for them by number.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque

import msgpack
import zmq

HASH_MASK = (1 << 64) - 1
# vLLM's name for the engine's own block pool, whatever device holds it; other media are tiers a router
# credits less (the blocks would have to be copied in first)
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends an answer to a replay request, as in vLLM
POLL_S = 0.05  # the publisher thread looks at the replay socket at least this often


def wire_hash(block_hash: int) -> int:
    """Python's hashes are signed; the wire carries unsigned 64-bit integers."""
    return block_hash & HASH_MASK


def wire_event(event: tuple, block_size: int) -> dict:
    """One block-manager cache event as vLLM's tagged event struct (a map with its class under "type")."""
    kind = event[0]
    if kind == "stored":
        _, parent, hashes, token_ids = event
        return {"type": "BlockStored", "block_hashes": [wire_hash(h) for h in hashes],
                "parent_block_hash": None if parent is None else wire_hash(parent),
                "token_ids": list(token_ids), "block_size": block_size,
                "lora_id": None, "medium": MEDIUM, "lora_name": None}
    if kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": [wire_hash(h) for h in event[1]], "medium": MEDIUM}
    if kind == "cleared":
        return {"type": "AllBlocksCleared"}
    raise ValueError(f"unknown cache event {event!r}")


def encode_batch(ts: float, events: list[tuple], block_size: int) -> bytes:
    """An EventBatch: [timestamp, events] (no data-parallel rank: one publisher per engine)."""
    return msgpack.packb([ts, [wire_event(e, block_size) for e in events]])


class KVEventPublisher:
    """Publishes batches of cache events on a PUB socket bound to `endpoint` (e.g. tcp://127.0.0.1:5557),
    with an optional ROUTER socket at `replay_endpoint` that re-sends the last `replay_batches` batches."""

    def __init__(self, endpoint: str, block_size: int, *, replay_endpoint: str | None = None, topic: str = "",
                 max_queue: int = 1024, replay_batches: int = 10_000):
        self.block_size, self.topic = block_size, topic.encode()
        self.published = self.dropped = 0  # batches sent, batches lost to a full queue
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._seq = itertools.count()
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)
        # bound here, so a taken port fails at startup; from then on only the publisher thread uses them
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[tuple]) -> None:
        """Queue one step's cache events (block-manager tuples) as a batch; never blocks."""
        if not events:
            return
        seq = next(self._seq)
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then close the sockets."""
        self._closing = True
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                seq, ts, events = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if self._closing:
                    return
                continue
            payload = encode_batch(ts, events, self.block_size)
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
            self._replay_buffer.append((seq, payload))
            self.published += 1

    def _answer_replay(self) -> None:
        """A request [identity, "", first seq] gets every kept batch from that number on, then END_SEQ."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # not a replay request: nothing to answer
        identity, _, first = frames
        start = int.from_bytes(first, "big")
        for seq, payload in list(self._replay_buffer):
            if seq >= start:
                self._replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([identity, b"", END_SEQ, b""])

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
