"""Prefill/decode disaggregation across servers (server/kv_transfer.py): a producer and a consumer on one
Redis behind `vllm-router --vllm-pd-disaggregation` answer every request token for token like one
colocated server, while the consumer computes at most one block of each prompt; a consumer whose blocks
never come recomputes them after its bounded wait. Needs vllm-router and redis-server (skips without)."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from kv_store_support import RedisServer, free_port
from server_support import make_char_checkpoint, running_server

from mini_transformer.engine import EngineConfig

BLOCK = 4
LOAD_TIMEOUT_S = 0.5
ROUTER_START_S = 30.0  # a bound, not an expectation
PROMPTS = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine, they said, twice",
           "Pack my box with five dozen liquor jugs.", "ok", "Sphinx of black quartz, judge my vow: 42 times"]


def router_binary() -> str:
    binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    if not Path(binary).exists():
        pytest.skip("vllm-router is not installed (it is a dev dependency: uv sync)")
    return binary


@contextlib.contextmanager
def pd_router(prefill_url: str, decode_url: str, log_path: Path):
    """vllm-router in vLLM's disaggregated mode on a free port, stopped when the block ends."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([router_binary(), "--host", "127.0.0.1", "--port", str(port),
                                 "--vllm-pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url,
                                 "--policy", "round_robin", "--worker-startup-check-interval", "1",
                                 "--prometheus-port", str(free_port()), "--log-level", "warning"],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_START_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    router_binary()
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()
    checkpoint = tmp_path_factory.mktemp("ckpt")
    make_char_checkpoint(checkpoint, max_seq_len=96)
    config = EngineConfig(block_size=BLOCK)
    try:
        with (running_server(checkpoint, config=config) as colocated,
              running_server(checkpoint, config=config, kv_store=redis.url, kv_role="producer") as producer,
              running_server(checkpoint, config=config, kv_store=redis.url, kv_role="consumer",
                             kv_load_timeout_s=LOAD_TIMEOUT_S) as consumer,
              pd_router(producer.url, consumer.url, tmp_path_factory.mktemp("router") / "log") as router):
            yield colocated, producer, consumer, router
    finally:
        redis.stop()


def completion(url: str, model: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response


def computed(server) -> dict:
    stats = server.wait_idle()["stats"]
    return {k: stats[k] for k in ("prefill_tokens_computed", "kv_store_hit_tokens")}


def waits(server, outcome: str) -> float:
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    name = f'mini_transformer_kv_transfer_waits_total{{outcome="{outcome}"'
    line = next(x for x in metrics.splitlines() if x.startswith(name))
    return float(line.rsplit(" ", 1)[1])


def test_pd_through_router_matches_colocated(cluster):
    colocated, producer, consumer, router = cluster
    model = colocated.ctx.model_name
    for prompt in PROMPTS:
        expected = completion(colocated.url, model, prompt).json()["choices"][0]["text"]
        before = computed(consumer)
        answer = completion(router, model, prompt).json()
        assert answer["choices"][0]["text"] == expected, prompt
        after = computed(consumer)
        n = len(prompt)  # one token per character
        assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] <= BLOCK
        assert after["kv_store_hit_tokens"] - before["kv_store_hit_tokens"] == BLOCK * ((n - 1) // BLOCK)
    assert waits(producer, "saved") >= len(PROMPTS)
    assert waits(consumer, "loaded") == len(PROMPTS)
    assert waits(consumer, "timed_out") == 0


def test_pd_streamed_chat_matches_colocated(cluster):
    colocated, _, consumer, router = cluster
    body = {"model": colocated.ctx.model_name, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three colours, please."}]}
    expected = httpx.post(f"{colocated.url}/v1/chat/completions", json=body, timeout=60).json()
    with httpx.stream("POST", f"{router}/v1/chat/completions", json=body | {"stream": True}, timeout=60) as r:
        assert r.status_code == 200
        chunks = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    text = "".join(json.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    assert text == expected["choices"][0]["message"]["content"]
    assert consumer.wait_idle()["stats"]["kv_store_hit_tokens"] > 0


def test_producer_answers_with_its_transfer_params(cluster):
    _, producer, _, _ = cluster
    answer = completion(producer.url, producer.ctx.model_name, "what the producer says", max_tokens=1).json()
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["remote_engine_id"] == producer.ctx.engine_loop.engine.kv_connector.fingerprint.hex()


def test_consumer_recomputes_blocks_that_never_come(cluster):
    colocated, producer, consumer, _ = cluster
    model = colocated.ctx.model_name
    prompt = "no producer ever saw this prompt, so its blocks never come"
    expected = completion(colocated.url, model, prompt).json()["choices"][0]["text"]
    engine_id = producer.ctx.engine_loop.engine.kv_connector.fingerprint.hex()
    transfer = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id}
    before, timed_out = computed(consumer), waits(consumer, "timed_out")
    started = time.monotonic()
    answer = completion(consumer.url, model, prompt, kv_transfer_params=transfer).json()
    assert time.monotonic() - started >= LOAD_TIMEOUT_S  # it waited, bounded, then went on
    assert answer["choices"][0]["text"] == expected
    after = computed(consumer)
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == len(prompt)
    assert waits(consumer, "timed_out") == timed_out + 1


def test_consumer_refuses_malformed_transfer_params(cluster):
    _, _, consumer, _ = cluster
    body = {"model": consumer.ctx.model_name, "prompt": "x", "max_tokens": 1, "kv_transfer_params": [1]}
    response = httpx.post(f"{consumer.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "kv_transfer_params"


def test_kv_role_options_are_checked(tmp_path):
    from mini_transformer.server import build_context

    make_char_checkpoint(tmp_path, max_seq_len=32)
    with pytest.raises(ValueError, match="needs a kv_store"):
        build_context(tmp_path, kv_role="consumer")
    with pytest.raises(ValueError, match="kv_role='decoder' must be one of producer, consumer"):
        build_context(tmp_path, kv_role="decoder", kv_store="redis://127.0.0.1:1")
