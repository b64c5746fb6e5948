"""Two servers on one Redis (`serve --kv-store`): the second reuses the prompt blocks the first stored,
answers the same text as a server without a store, and /metrics, /v1/engine/state and the live page's
data report where blocks came from. The store's secret and Redis's password come from a file or the
environment, never the command line. Needs Debian's redis-server (skips without it)."""

from __future__ import annotations

import shutil

import httpx
import pytest
from kv_store_support import RedisServer, free_port
from server_support import make_char_checkpoint, running_server

from mini_transformer.engine import EngineConfig
from mini_transformer.server import build_context
from mini_transformer.server.run import KV_STORE_SECRET_ENV, REDIS_PASSWORD_ENV, kv_connector, kv_store_secret_from

PROMPT = "the quick brown fox jumps over the lazy dog, again and again, " * 2  # 128 characters


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    make_char_checkpoint(path, max_seq_len=160)
    return path


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def complete(server) -> str:
    body = {"model": server.ctx.model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_two_replicas_share_prefix_blocks(checkpoint, redis_server):
    with running_server(checkpoint, config=EngineConfig(block_size=16)) as plain:
        expected = complete(plain)
    with running_server(checkpoint, config=EngineConfig(block_size=16), kv_store=redis_server.url,
                        host_kv_bytes=1 << 22) as a:
        assert complete(a) == expected
        a.wait_idle()
        a.ctx.engine_loop.engine.kv_connector.flush()
        saved = a.ctx.engine_loop.engine.stats()["kv_store_blocks_saved"]
        assert saved >= len(PROMPT) // 16
    with running_server(checkpoint, config=EngineConfig(block_size=16), kv_store=redis_server.url) as b:
        assert complete(b) == expected
        state = b.wait_idle()
        engine_stats = b.ctx.engine_loop.engine.stats()
        assert engine_stats["kv_store_blocks_loaded_redis"] == (len(PROMPT) - 1) // 16  # one token per char
        assert engine_stats["prefill_tokens_computed"] == len(PROMPT) - 16 * ((len(PROMPT) - 1) // 16)
        state = httpx.get(f"{b.url}/v1/engine/state", timeout=10).json()
        assert state["kv_store"]["blocks_loaded_redis"] == engine_stats["kv_store_blocks_loaded_redis"]
        assert state["pool"]["tier"].count("redis") == engine_stats["kv_store_blocks_loaded_redis"]
        metrics = httpx.get(f"{b.url}/metrics", timeout=10).text
        loaded = engine_stats["kv_store_blocks_loaded_redis"]
        assert f'mini_transformer_kv_store_blocks_loaded{{tier="redis"}} {float(loaded)}' in metrics
        assert "mini_transformer_kv_store_lookup_hit_rate 1.0" in metrics
        assert "mini_transformer_kv_store_errors 0.0" in metrics
        live_page_marks_loaded_blocks(b.url, loaded)


def live_page_marks_loaded_blocks(url: str, loaded: int) -> None:
    """The live page (headless Chromium, as tests/test_server_page.py drives it) marks the blocks that came
    from Redis and names the store's counters; skipped where Chromium or Playwright is absent."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(url + "/", timeout=30_000)
            page.wait_for_function(f"document.querySelectorAll('#grid .block.from-redis').length === {loaded}",
                                   timeout=30_000)
            assert "blocks loaded redis " + str(loaded) in page.locator("#kv-store").text_content()
            assert not errors, errors
        finally:
            browser.close()


def test_bad_kv_store_options_are_refused(checkpoint):
    with pytest.raises(ValueError, match="redis://HOST:PORT"):
        build_context(checkpoint, kv_store="http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="host_kv_bytes"):
        build_context(checkpoint, host_kv_bytes=0)


def test_the_store_secret_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(KV_STORE_SECRET_ENV, raising=False)
    assert kv_store_secret_from(None) is None
    monkeypatch.setenv(KV_STORE_SECRET_ENV, "a secret from the environment")
    assert kv_store_secret_from(None) == b"a secret from the environment"
    (tmp_path / "secret").write_text("a secret from a file, shared\n")
    assert kv_store_secret_from(tmp_path / "secret") == b"a secret from a file, shared"
    monkeypatch.setenv(KV_STORE_SECRET_ENV, "short")
    with pytest.raises(ValueError, match=f"{KV_STORE_SECRET_ENV} holds 5 bytes"):
        kv_store_secret_from(None)


def test_an_unsigned_store_says_so_in_one_line(capsys):
    url = f"redis://127.0.0.1:{free_port()}"  # nobody listens: the tier logs it and the engine recomputes
    unsigned = kv_connector(url, None)
    err = capsys.readouterr().err
    assert not unsigned.signed and err.count("\n") == 1 and "not signed" in err and "trusted" in err
    signed = kv_connector(url, None, b"a secret the replicas share")
    assert signed.signed and capsys.readouterr().err == ""
    for connector in (unsigned, signed):
        connector.close()


def test_the_redis_password_from_the_environment(tmp_path, monkeypatch):
    server = RedisServer(tmp_path, password="from-the-environment").start()
    try:
        monkeypatch.setenv(REDIS_PASSWORD_ENV, "from-the-environment")
        connector = kv_connector(server.url, None, b"a secret the replicas share")
        tier = connector.tiers[0]
        assert tier.ping() and tier.errors == 0
        connector.close()
        monkeypatch.setenv(REDIS_PASSWORD_ENV, "wrong")
        connector = kv_connector(server.url, None, b"a secret the replicas share")
        assert connector.tiers[0].errors == 1
        connector.close()
    finally:
        server.stop()
