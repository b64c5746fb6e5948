"""KVConnector: the engine's door to a KV store that outlives one pool (vLLM v1's KV connector, small).

The device pool forgets a block when it needs the room, and another replica never sees it. The
connector keeps full blocks in tiers behind the pool (kv_tiers.py: HostTier, RedisTier) and gives them
back to any engine serving the same model:

    lookup(seq, num_cached)  scheduling a waiting request: how many full blocks AFTER those the device
                             pool holds can a tier give (the longest run of the chain); the values are
                             fetched and checked now (vLLM: get_num_new_matched_tokens)
    load(seq, block_ids)     the scheduler allocated pool blocks for them: copy the K/V in
                             (vLLM: update_state_after_alloc + start_load_kv)
    save(scheduled)          after a forward pass: every block it completed is copied off the pool, and
                             a writer thread encodes it and writes it to the tiers (write-behind: the
                             step does not wait for Redis; an entry appears whole or not at all)
    wait_saved(timeout)      any thread: wait until every save queued so far has reached the tiers (a
                             prefill server answers only then: server/kv_transfer.py)
    stored_run(ids, n)       any thread: how many of the first n full blocks of a prompt the tiers
                             hold now, unchecked (a decode server waits for blocks still in flight)

The key of block i is the model's FINGERPRINT (config, dtype, block size, a digest of the weights) and
a chain hash, key_i = H(key_{i-1}, tokens of block i), the same chain as the block manager's but with a
digest that is equal in every process (Python's hash() is not). Equal keys should mean equal prefixes,
but a key can collide, an entry can rot, and anyone who can write to the store can plant one, so every
value is checked before use: its MAC, its fingerprint, and its token ids against the request's. A
failed check is a counted miss, never used. The entry's format and its MAC: kv_entry.py.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field

import torch

from .kv_entry import chain_digest, decode_block, encode_block, mac_key_for, model_fingerprint

SAVE_QUEUE_BLOCKS = 4096  # saves waiting for the writer beyond this are dropped (counted), never waited on


def extend_chain(chain: list[bytes], tokens, block_size: int, num_blocks: int) -> list[bytes]:
    """Grow `chain` to the digests of the first num_blocks full blocks of `tokens`:
    digest_0 = H(b"", block 0's tokens), digest_i = H(digest_{i-1}, block i's tokens)."""
    while len(chain) < num_blocks:
        i = len(chain)
        chain.append(chain_digest(chain[-1] if chain else b"", tokens[i * block_size:(i + 1) * block_size]))
    return chain


def longest_run(tiers, keys: list[bytes], check) -> tuple[list[tuple[int, bytes, object]], int]:
    """The longest unbroken run of consecutive blocks `keys` that the tiers hold. Each block is taken from
    the fastest tier that has its key (one get_many per tier, for the keys the faster ones lacked);
    check(i, value) returns the decoded block, or None when the value fails a check: the run ends there
    and the refusal is counted. Returns ([(tier index, value, decoded)], refusals)."""
    values: list[tuple[int, bytes | None]] = [(-1, None)] * len(keys)
    for t, tier in enumerate(tiers):  # fill the gaps of the faster tiers from the next one
        gaps = [i for i, (_, v) in enumerate(values) if v is None]
        if not gaps:
            break
        for i, value in zip(gaps, tier.get_many([keys[i] for i in gaps]), strict=True):
            if value is not None:
                values[i] = (t, value)
    run = []
    for i, (t, value) in enumerate(values):
        if value is None:
            break
        decoded = check(i, value)
        if decoded is None:
            return run, 1
        run.append((t, value, decoded))
    return run, 0


@dataclass
class KVStoreCounters:
    """What the connector has done since it started; only the connector adds to them (its writer thread
    counts the saves), stats() reads them."""

    lookups: int = 0
    lookup_blocks: int = 0  # full blocks asked of the tiers
    hit_blocks: int = 0  # of those, found and checked
    verify_failures: int = 0  # found but refused by a check: a miss
    blocks_saved: int = 0
    bytes_saved: int = 0
    saves_dropped: int = 0  # the writer's queue was full
    bytes_loaded: int = 0  # K/V bytes copied into the pool
    wire_bytes_loaded: int = 0  # encoded bytes read from the tiers
    blocks_loaded: dict[str, int] = field(default_factory=dict)  # tier name -> blocks loaded from it

    def as_dict(self) -> dict[str, int]:
        """Flat: blocks_loaded comes as blocks_loaded_<tier>."""
        flat = asdict(self)
        return flat | {f"blocks_loaded_{name}": n for name, n in flat.pop("blocks_loaded").items()}


class KVConnector:
    """Give it tiers, fastest first (e.g. [HostTier(2 << 30), RedisTier("redis://127.0.0.1:6379")]) and
    pass it to LLMEngine(kv_connector=...), which binds it to its model and pool."""

    def __init__(self, tiers: list, *, secret: bytes | None = None, write_behind: bool = True):
        if not tiers or not all(hasattr(t, "get_many") and hasattr(t, "put") for t in tiers):
            raise TypeError("tiers must be a non-empty list of tiers (HostTier, RedisTier)")
        self.tiers, self.write_behind = list(tiers), write_behind
        self.signed, self._mac_key = secret is not None, mac_key_for(secret)
        self.fingerprint = b""
        self._keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> its chain of keys
        self._pending = None  # (seq, first block, its length, [(tier name, K/V)]): what lookup found, for load
        self.block_origin: dict[int, tuple[str, int]] = {}  # pool block id -> (tier, block generation)
        self.counters = KVStoreCounters(blocks_loaded={t.name: 0 for t in self.tiers})
        self._queue: queue.Queue = queue.Queue(SAVE_QUEUE_BLOCKS)
        self._writer: threading.Thread | None = None

    # -------------------------------------------------------------------------------- binding
    def bind(self, model, kv_cache: torch.Tensor, block_size: int) -> None:
        """Called once by LLMEngine: the pool (2, n_layer, num_slots, Hkv, D) and the model's fingerprint."""
        assert not self.fingerprint, "a connector serves one engine"
        self.kv_cache, self.block_size = kv_cache, block_size
        self.block_shape = (2, kv_cache.shape[1], block_size, *kv_cache.shape[3:])  # (2, L, bs, Hkv, D)
        self.fingerprint = model_fingerprint(model, block_size)
        self._prefix = b"mtkv:" + self.fingerprint.hex().encode() + b":"
        if self.write_behind:
            self._writer = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
            self._writer.start()

    def keys(self, seq, num_blocks: int) -> list[bytes]:
        """The store keys of seq's first num_blocks full blocks (kept and extended: tokens only grow)."""
        chain = self._keys.setdefault(seq, [])
        if len(chain) < num_blocks:
            extend_chain(chain, seq.tokens, self.block_size, num_blocks)
        return [self._prefix + digest for digest in chain[:num_blocks]]

    # ------------------------------------------------------------------------------- loading
    def lookup(self, seq, num_cached_blocks: int) -> int:
        """How many full blocks after the first num_cached_blocks (already in the pool) the tiers give, as
        one unbroken run; fetched and checked now, and kept for load(). Like the pool, only blocks inside
        the first num_tokens - 1 tokens count: the step must compute the last token for its logits."""
        pending = self._pending
        if pending is not None and pending[:3] == (seq, num_cached_blocks, seq.num_tokens):
            return len(pending[3])  # the same request still waiting for room: no second round trip
        wanted = self.keys(seq, (seq.num_tokens - 1) // self.block_size)[num_cached_blocks:]
        self.counters.lookups += 1
        self.counters.lookup_blocks += len(wanted)
        tokens, bs = seq.tokens, self.block_size

        def check(i: int, value: bytes):
            block = num_cached_blocks + i
            return decode_block(value, self.fingerprint, tokens[block * bs:(block + 1) * bs], self.block_shape,
                                self.kv_cache.dtype, store_key=wanted[i], mac_key=self._mac_key)

        run, refused = longest_run(self.tiers, wanted, check)
        self.counters.verify_failures += refused  # a miss, counted; the block is computed instead
        found = [(self.tiers[t].name, kv) for t, _, kv in run]
        for i, (t, value, _) in enumerate(run):
            self.counters.wire_bytes_loaded += len(value)
            if t:
                self.tiers[0].put(wanted[i], value)  # promote: the next hit is a faster tier's
        self.counters.hit_blocks += len(found)
        self._pending = (seq, num_cached_blocks, seq.num_tokens, found)
        return len(found)

    def load(self, seq, block_ids: list[int], generations: list[int]) -> None:
        """Copy what lookup(seq, ...) found into the freshly allocated pool blocks `block_ids`."""
        pending_seq, _, _, found = self._pending
        assert pending_seq is seq and len(found) == len(block_ids), "load follows its lookup"
        self._pending = None
        bs = self.block_size
        for block_id, generation, (tier_name, kv) in zip(block_ids, generations, found, strict=True):
            self.kv_cache[:, :, block_id * bs:(block_id + 1) * bs] = kv.to(self.kv_cache.device)
            self.block_origin[block_id] = (tier_name, generation)
            self.counters.blocks_loaded[tier_name] += 1
            self.counters.bytes_loaded += kv.numel() * kv.element_size()

    # -------------------------------------------------------------------------------- saving
    def save(self, scheduled) -> None:
        """After a forward pass over `scheduled` (sequence, tokens computed) pairs, and BEFORE the engine
        counts those tokens: copy every block the pass completed off the pool (now, before the block can
        be reused) and queue it for the tiers."""
        bs, copies = self.block_size, []
        for seq, n in scheduled:
            first, last = seq.num_computed_tokens // bs, (seq.num_computed_tokens + n) // bs
            if first >= last:
                continue
            keys, tokens = self.keys(seq, last), seq.tokens_between(first * bs, last * bs)
            for i in range(first, last):
                block_id = seq.block_table[i]
                kv = self.kv_cache[:, :, block_id * bs:(block_id + 1) * bs]  # (2, L, bs, Hkv, D)
                copies.append((keys[i], tokens[(i - first) * bs:(i - first + 1) * bs], self._copy_off(kv)))
        if not copies:
            return
        done = None
        if self.kv_cache.device.type == "cuda":  # the copies run async; the writer waits on this event
            done = torch.cuda.Event()
            done.record()
        for key, token_ids, kv in copies:
            if self.write_behind:
                try:
                    self._queue.put_nowait((key, token_ids, kv, done))
                except queue.Full:
                    self.counters.saves_dropped += 1
            else:
                self._write(key, token_ids, kv, done)

    def wait_saved(self, timeout: float) -> bool:
        """Block until the writer has written every save queued before this call (False: still busy after
        `timeout` seconds). A marker goes through the same FIFO queue as the blocks, so other requests'
        later saves do not extend the wait."""
        if self._writer is None:
            return True
        reached, deadline = threading.Event(), time.monotonic() + timeout
        try:
            self._queue.put(reached, timeout=timeout)
        except queue.Full:
            return False
        return reached.wait(max(0.0, deadline - time.monotonic()))

    def stored_run(self, token_ids: list[int], num_blocks: int) -> int:
        """How many of the first num_blocks full blocks of `token_ids` some tier holds, as one unbroken run
        from the start. Only presence: lookup() still checks each value before it is used."""
        keys = [self._prefix + d for d in extend_chain([], token_ids, self.block_size, num_blocks)]
        present = [False] * len(keys)
        for tier in self.tiers:
            present = [p or h for p, h in zip(present, tier.has_many(keys), strict=True)]
        return present.index(False) if False in present else len(present)

    def _copy_off(self, kv: torch.Tensor) -> torch.Tensor:
        if kv.device.type == "cpu":
            return kv.clone()
        host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
        return host.copy_(kv, non_blocking=True)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if isinstance(item, threading.Event):  # wait_saved's marker: everything before it is written
                    item.set()
                    continue
                self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, token_ids, kv: torch.Tensor, done) -> None:
        if done is not None:
            done.synchronize()
        value = encode_block(self.fingerprint, self.block_size, token_ids, kv, store_key=key, mac_key=self._mac_key)
        for tier in self.tiers:
            tier.put(key, value)  # a tier that is down drops it (and counts); the block is just not shared
        self.counters.blocks_saved += 1
        self.counters.bytes_saved += len(value)

    def flush(self) -> None:
        """Wait until every queued save reached the tiers (tests, benchmarks, shutdown)."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=10)
        for tier in self.tiers:
            if hasattr(tier, "close"):
                tier.close()

    # --------------------------------------------------------------------------------- views
    def stats(self) -> dict:
        """Counters since start, with the tiers' own: errors (failed calls) and the hit rate."""
        c = self.counters.as_dict()
        c["lookup_hit_rate"] = round(c["hit_blocks"] / c["lookup_blocks"], 4) if c["lookup_blocks"] else 0.0
        c["store_errors"] = sum(t.errors for t in self.tiers)
        c["pending_saves"] = self._queue.qsize()
        return c

    def block_tiers(self, blocks) -> tuple[str, ...]:
        """Per pool block: the tier its K/V came from ("" if computed here), while it still holds them."""
        return tuple(origin[0] if (origin := self.block_origin.get(b.block_id)) and origin[1] == b.generation
                     else "" for b in blocks)
