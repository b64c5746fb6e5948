"""The tiers of the KV store: where full KV blocks live once the device pool has let them go.

    device pool (engine/block_manager.py)  ->  HostTier (this process's RAM)  ->  RedisTier (shared)

A tier maps a key (bytes: the model's fingerprint and one block's place in a prefix hash chain, see
kv_connector.py) to a value (bytes: the block's K/V for every layer, its token ids and a MAC). A
tier never interprets values: the connector checks every value it gets before it uses it, so a tier
may lose, evict or even damage entries without ever making the engine serve a wrong token.

A tier never raises and never blocks for long. RedisTier bounds every call by a socket timeout; after a
failure it counts it, logs ONE line, and answers "not here" to everything until `retry_after_s` has
passed, then tries again (the client reconnects by itself). The engine meanwhile recomputes.

RedisTier takes redis-py's own urls: a user and password (`redis://user:pass@host:port/db`, or given
apart so that no command line shows them) and TLS (`rediss://`). Every line it logs shows the url with
the password masked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from urllib.parse import urlsplit

log = logging.getLogger("mini_transformer.kv_store")


class HostTier:
    """An LRU of blocks in host memory, sized in bytes (of values). On a GPU this is the offload tier;
    on a CPU it is a second, larger pool. Thread-safe: the engine reads, the connector's writer writes."""

    name = "host"

    def __init__(self, capacity_bytes: int):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes={capacity_bytes!r} must be a positive integer")
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self.evictions = 0
        self.errors = 0  # a dict in RAM does not fail; kept so every tier reports the same counters
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        with self._lock:
            values = [self._entries.get(key) for key in keys]
            for key, value in zip(keys, values, strict=True):
                if value is not None:
                    self._entries.move_to_end(key)  # recently used: evicted last
        return values

    def has_many(self, keys: list[bytes]) -> list[bool]:
        """Which keys are here, without reading the values or touching the LRU order."""
        with self._lock:
            return [key in self._entries for key in keys]

    def put(self, key: bytes, value: bytes) -> bool:
        if len(value) > self.capacity_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            self.bytes_used -= 0 if old is None else len(old)
            self._entries[key] = value
            self.bytes_used += len(value)
            while self.bytes_used > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.bytes_used -= len(evicted)
                self.evictions += 1
        return True


def parse_redis_url(url: str) -> tuple[str, int]:
    """redis[s]://[[USER]:PASSWORD@]HOST:PORT[/DB] -> (host, port); anything else is refused at the door
    with the reason, and the password never appears in the message."""
    if not isinstance(url, str):
        raise TypeError(f"kv store url must be a string like redis://127.0.0.1:6379, got {type(url).__name__}")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    path = parts.path.strip("/")
    if parts.scheme not in ("redis", "rediss") or not parts.hostname or port is None or not (path == ""
                                                                                        or path.isdigit()):
        raise ValueError(f"kv store url {masked_url(url)!r} must look like redis://HOST:PORT (e.g. "
                         f"redis://127.0.0.1:6379; redis://USER:PASSWORD@HOST:PORT/DB, rediss:// for TLS)")
    return parts.hostname, port


def masked_url(url: str) -> str:
    """`url` with its password replaced by ***, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@" + parts.netloc.rpartition("@")[2]).geturl()


class RedisTier:
    """Blocks in a Redis server shared by every replica. Entries expire after `ttl_s` (and a server
    started with --maxmemory and an LRU policy evicts them under pressure); any replica may read what
    another one wrote, and the connector's checks make a stale or damaged entry a plain miss."""

    name = "redis"

    def __init__(self, url: str, *, username: str | None = None, password: str | None = None,
                 timeout_s: float = 0.25, ttl_s: float = 3600.0, retry_after_s: float = 2.0):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        parse_redis_url(url)
        for name, value in (("timeout_s", timeout_s), ("ttl_s", ttl_s), ("retry_after_s", retry_after_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive number of seconds")
        self.url, self.ttl_ms = masked_url(url), int(ttl_s * 1000)  # the url as logs show it
        self.retry_after_s = retry_after_s
        self._redis_error = redis.RedisError
        # every call waits at most timeout_s, and is tried once: the engine recomputes instead of waiting.
        # A user or password in the url wins over the ones given apart (redis-py's from_url)
        self._client = redis.Redis.from_url(url, username=username, password=password, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                                            health_check_interval=0)
        self.errors = 0  # calls that failed (refused, timed out, reset, wrong password)
        self._down_until = 0.0  # monotonic time before which we do not try (0: up)
        self._lock = threading.Lock()
        self.ping()  # down at start: counted and logged now, served by recomputing

    def ping(self) -> bool:
        return self._call(self._client.ping, False)

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        values = self._call(lambda: self._client.mget(keys), None)
        return [None] * len(keys) if values is None else values

    def has_many(self, keys: list[bytes]) -> list[bool]:
        """Which keys are here (one round trip of EXISTS, no values moved); all False while down."""
        if not keys:
            return []

        def exists():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(n) for n in pipe.execute()]

        return self._call(exists, None) or [False] * len(keys)

    def put(self, key: bytes, value: bytes) -> bool:
        return bool(self._call(lambda: self._client.set(key, value, px=self.ttl_ms), False))

    def _call(self, fn, failed):
        """Run one Redis call, or skip it while the server is known to be down; never raises."""
        with self._lock:
            if time.monotonic() < self._down_until:
                return failed
        try:
            result = fn()
        except self._redis_error as err:  # ConnectionError, TimeoutError, AuthenticationError, ResponseError
            self._failed(err)
            return failed
        with self._lock:
            if self._down_until:
                self._down_until = 0.0
                log.warning("kv store %s is reachable again", self.url)
        return result

    def _failed(self, err: Exception) -> None:
        with self._lock:
            self.errors += 1
            first = not self._down_until  # one log line per outage, not one per call
            self._down_until = time.monotonic() + self.retry_after_s
        if first:
            log.warning("kv store %s failed (%s: %s); recomputing instead, retrying in %.1f s",
                        self.url, type(err).__name__, err, self.retry_after_s)

    def close(self) -> None:
        self._client.close()
