"""The KV store's tiers: HostTier is an LRU sized in bytes; RedisTier refuses a bad url at the door, and
every Redis fault (down at start, killed mid-run then back, stalled, entries damaged) costs recomputation
only: the outputs stay generate()'s token for token, the failures are counted and logged once, nothing
hangs. Each fault test runs its own real redis-server (skip without the binary)."""

from __future__ import annotations

import logging
import time

import pytest
from kv_store_support import (
    HANG_GUARD_S,
    PARAMS,
    RedisServer,
    free_port,
    make_model,
    prompts_and_fillers,
    reference,
    serve_twice,
    small_engine,
)

from mini_transformer.engine.kv_connector import KVConnector
from mini_transformer.engine.kv_tiers import HostTier, RedisTier, masked_url, parse_redis_url


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request):
    return make_model(request.param)


@pytest.fixture(scope="module")
def expected(model):
    return reference(model, prompts_and_fillers()[0])


@pytest.fixture
def empty_redis(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def test_host_tier_evicts_least_recently_used_by_bytes():
    tier = HostTier(30)
    for key in (b"a", b"b", b"c"):
        tier.put(key, b"x" * 10)
    tier.get_many([b"a"])  # a is now the most recent
    tier.put(b"d", b"x" * 10)
    assert tier.get_many([b"a", b"b", b"c", b"d"]) == [b"x" * 10, None, b"x" * 10, b"x" * 10]
    assert tier.bytes_used == 30 and tier.evictions == 1 and not tier.put(b"e", b"x" * 31)


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://127.0.0.1", "redis://:6379", "redis://h:99999",
                                 "redis://:pass-word@h", "rediss://u:pass-word@h:1/db0"])
def test_bad_store_urls_are_refused(url):
    with pytest.raises(ValueError, match="redis://HOST:PORT") as err:
        parse_redis_url(url)
    assert "pass-word" not in str(err.value)


@pytest.mark.parametrize("url, masked", [("redis://h:1", "redis://h:1"), ("redis://:pw@h:1", "redis://:***@h:1"),
                                         ("rediss://user:p%40w@h:1/2", "rediss://user:***@h:1/2")])
def test_urls_with_credentials_and_tls_parse_and_mask(url, masked):
    assert parse_redis_url(url) == ("h", 1) and masked_url(url) == masked


def test_rediss_reaches_redis_py_as_tls_with_the_credentials():
    """The connection redis-py would open (nothing listens on the port: the tier logs it and goes on)."""
    tier = RedisTier(f"rediss://app:pw@127.0.0.1:{free_port()}/3", timeout_s=0.1)
    pool = tier._client.connection_pool
    assert pool.connection_class.__name__ == "SSLConnection"
    assert (pool.connection_kwargs["username"], pool.connection_kwargs["password"], pool.connection_kwargs["db"]) \
        == ("app", "pw", 3)
    apart = RedisTier(f"redis://127.0.0.1:{free_port()}", username="u", password="given apart", timeout_s=0.1)
    assert apart._client.connection_pool.connection_class.__name__ == "Connection"
    assert apart._client.connection_pool.connection_kwargs["password"] == "given apart"


# -------------------------------------------------------------------------------------- faults
def store_log_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mini_transformer.kv_store"]


def test_redis_down_at_start(model, expected, caplog):
    caplog.set_level(logging.WARNING, logger="mini_transformer.kv_store")
    start = time.monotonic()
    engine = small_engine(model, 4, KVConnector([RedisTier(f"redis://127.0.0.1:{free_port()}", timeout_s=0.2)]))
    first, second = serve_twice(engine, *prompts_and_fillers())
    assert time.monotonic() - start < HANG_GUARD_S
    assert first == second == expected
    stats = engine.stats()
    assert stats["kv_store_store_errors"] >= 1 and stats["kv_store_hit_blocks"] == 0
    assert len(store_log_lines(caplog)) == 1, store_log_lines(caplog)


def test_redis_killed_mid_run_then_back(model, expected, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="mini_transformer.kv_store")
    server = RedisServer(tmp_path).start()
    try:
        tier = RedisTier(server.url, timeout_s=0.2, retry_after_s=0.3)
        engine = small_engine(model, 4, KVConnector([tier]))
        prompts, fillers = prompts_and_fillers()
        assert engine.generate(prompts, PARAMS, use_tqdm=False) == expected
        engine.kv_connector.flush()
        server.kill()
        start = time.monotonic()
        engine.generate(fillers, PARAMS, use_tqdm=False)
        assert engine.generate(prompts, PARAMS, use_tqdm=False) == expected
        assert time.monotonic() - start < HANG_GUARD_S
        stats = engine.stats()
        assert stats["kv_store_store_errors"] >= 1 and stats["kv_store_blocks_loaded_redis"] == 0
        assert len(store_log_lines(caplog)) == 1, store_log_lines(caplog)
        server.start()  # back, empty, on the same port: the tier reconnects once retry_after_s has passed
        time.sleep(0.4)
        engine.generate(fillers, PARAMS, use_tqdm=False)
        engine.kv_connector.flush()
        assert server.client().dbsize() > 0, "saves reach the restarted server"
        assert "reachable again" in store_log_lines(caplog)[-1]
    finally:
        server.stop()


def test_redis_stalled_times_out(model, expected, tmp_path):
    server = RedisServer(tmp_path).start()
    try:
        engine = small_engine(model, 4, KVConnector([RedisTier(server.url, timeout_s=0.2)]))
        prompts, fillers = prompts_and_fillers()
        engine.generate(prompts, PARAMS, use_tqdm=False)
        engine.generate(fillers, PARAMS, use_tqdm=False)
        engine.kv_connector.flush()
        server.pause()  # alive, holding its entries, answering nothing
        start = time.monotonic()
        assert engine.generate(prompts, PARAMS, use_tqdm=False) == expected
        engine.kv_connector.flush()
        assert time.monotonic() - start < HANG_GUARD_S
        stats = engine.stats()
        assert stats["kv_store_store_errors"] >= 1 and stats["kv_store_blocks_loaded_redis"] == 0
    finally:
        server.stop()


def test_corrupted_entries_are_detected(model, expected, empty_redis):
    engine = small_engine(model, 4, KVConnector([RedisTier(empty_redis.url)]))
    prompts, fillers = prompts_and_fillers()
    engine.generate(prompts, PARAMS, use_tqdm=False)
    engine.generate(fillers, PARAMS, use_tqdm=False)
    engine.kv_connector.flush()
    client = empty_redis.client()
    for key in client.keys("mtkv:*"):  # flip one byte in the middle of the K/V of every entry
        middle = client.strlen(key) // 2
        byte = client.getrange(key, middle, middle)
        client.setrange(key, middle, bytes([byte[0] ^ 0x01]))
    assert engine.generate(prompts, PARAMS, use_tqdm=False) == expected
    stats = engine.stats()
    assert stats["kv_store_verify_failures"] >= 1 and stats["kv_store_blocks_loaded_redis"] == 0


# ----------------------------------------------------------------------------- authentication
PASSWORD = "s3cret-redis-pass"


def test_a_password_protected_redis(tmp_path, caplog):
    """The right password, from the url or given apart, is let in; a wrong or absent one is one log line
    that never shows it, and the tier answers "not here" (the engine recomputes)."""
    caplog.set_level(logging.WARNING, logger="mini_transformer.kv_store")
    server = RedisServer(tmp_path, password=PASSWORD).start()
    try:
        for tier in (RedisTier(f"redis://:{PASSWORD}@127.0.0.1:{server.port}"),
                     RedisTier(f"redis://default:{PASSWORD}@127.0.0.1:{server.port}/0"),
                     RedisTier(server.url, password=PASSWORD)):
            assert tier.put(b"k", b"v") and tier.get_many([b"k"]) == [b"v"] and tier.errors == 0
            tier.close()
        assert not store_log_lines(caplog)
        for url in (f"redis://:wrong-{PASSWORD}@127.0.0.1:{server.port}", server.url):
            caplog.clear()
            tier = RedisTier(url)
            assert tier.get_many([b"k"]) == [None] and tier.errors == 1
            lines = store_log_lines(caplog)
            assert len(lines) == 1 and "\n" not in lines[0] and PASSWORD not in lines[0], lines
            assert "AuthenticationError" in lines[0]
            tier.close()
    finally:
        server.stop()
