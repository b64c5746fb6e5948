"""The KV connector against generate() alone: with a host tier, a Redis tier or both, with device-pool
evictions forcing loads, every greedy output is the reference's, token for token. A second engine in
another process computes only the tail after the blocks the first one stored. Another model's blocks
are never used; a collided or damaged entry is a counted miss; Redis down, killed or stalled costs
recomputation, never a hang or a wrong token. The Redis tests run a real redis-server (skip without it)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
import torch
from redis_support import RedisServer, free_port

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM, generate
from mini_transformer.engine import LLMEngine
from mini_transformer.engine.kv_connector import KVConnector, decode_block, encode_block
from mini_transformer.engine.kv_tiers import HostTier, RedisTier, parse_redis_url

VOCAB, MAX_TOKENS = 50, 6
HANG_GUARD_S = 30  # a liveness bound for the fault tests (they take about a second): hanging fails, slow does not
PARAMS = SamplingParams(max_tokens=MAX_TOKENS)


def make_model(style: str, seed: int = 0) -> TransformerLM:
    extra = dict(pos_emb="rope", n_kv_heads=2, norm="rmsnorm", ffn="swiglu", bias=False) if style == "llama" else {}
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layer=2, d_ff=64, max_seq_len=64,
                            init_std=0.2, **extra)
    torch.manual_seed(seed)
    return TransformerLM(cfg).eval()


def prompts_and_fillers():
    """Three prompts sharing a 35-token prefix; then fillers that push them out of a small pool."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, VOCAB, (35,), generator=gen).tolist()
    prompts = [base + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 8, 1)]
    fillers = [torch.randint(0, VOCAB, (40,), generator=gen).tolist() for _ in range(3)]
    return prompts, fillers


def reference(model, prompts) -> list[list[int]]:
    return [generate(model, torch.tensor([p]), MAX_TOKENS)[0].tolist() for p in prompts]


def small_engine(model, block_size: int, connector: KVConnector | None) -> LLMEngine:
    """A pool twice the longest request: the fillers evict the prompts' blocks (and preempt at times)."""
    longest = -(-(43 + MAX_TOKENS) // block_size)
    return LLMEngine(model, block_size=block_size, num_blocks=2 * longest, kv_connector=connector)


def serve_twice(engine: LLMEngine, prompts, fillers) -> tuple[list, list]:
    """Prompts, fillers (evicting them from the pool), prompts again: the second time they can only come
    from the connector's tiers."""
    first = engine.generate(prompts, PARAMS, use_tqdm=False)
    engine.kv_connector.flush()
    engine.generate(fillers, PARAMS, use_tqdm=False)
    engine.kv_connector.flush()
    return first, engine.generate(prompts, PARAMS, use_tqdm=False)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request):
    return make_model(request.param)


@pytest.fixture(scope="module")
def expected(model):
    return reference(model, prompts_and_fillers()[0])


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def empty_redis(redis_server):
    redis_server.client().flushall()
    return redis_server


def kv_block_bytes(model, block_size: int) -> int:
    """The formula: 2 (k, v) · L · block_size · Hkv · D · 4 bytes (float32)."""
    cfg = model.config
    return 2 * cfg.n_layer * block_size * cfg.n_kv_heads * cfg.d_head * 4


def value_bytes(model, block_size: int) -> int:
    """A stored value: 29 header bytes, the token ids (int64), the K/V, a 16-byte checksum."""
    return 29 + 8 * block_size + kv_block_bytes(model, block_size) + 16


# ------------------------------------------------------------------------------ equal outputs
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("tiers", ["host", "redis", "both"])
def test_greedy_outputs_equal_without_connector(model, expected, block_size, tiers, request):
    made = []
    if tiers in ("host", "both"):  # "both": a host tier of 3 blocks, so most loads come from Redis
        made.append(HostTier(1 << 20 if tiers == "host" else 3 * value_bytes(model, block_size)))
    if tiers in ("redis", "both"):
        made.append(RedisTier(request.getfixturevalue("empty_redis").url))
    connector = KVConnector(made)
    engine = small_engine(model, block_size, connector)
    prompts, fillers = prompts_and_fillers()
    first, second = serve_twice(engine, prompts, fillers)
    assert first == expected and second == expected
    stats = engine.stats()
    loaded = {t.name: stats[f"kv_store_blocks_loaded_{t.name}"] for t in made}
    assert loaded[made[-1].name] > 0, f"the prompts' blocks should come back from the {made[-1].name} tier"
    assert stats["kv_store_hit_tokens"] == block_size * sum(loaded.values())
    assert stats["kv_store_verify_failures"] == stats["kv_store_store_errors"] == 0
    assert stats["kv_store_bytes_loaded"] == sum(loaded.values()) * kv_block_bytes(model, block_size)
    assert stats["kv_store_wire_bytes_loaded"] == sum(loaded.values()) * value_bytes(model, block_size)
    connector.close()


def test_loaded_blocks_are_tagged_with_their_tier(model):
    connector = KVConnector([HostTier(1 << 20)])
    engine = small_engine(model, 4, connector)
    prompts, fillers = prompts_and_fillers()
    serve_twice(engine, prompts, fillers)
    tiers = engine.snapshot().block_tier
    assert len(tiers) == engine.num_blocks and tiers.count("host") > 0 and set(tiers) <= {"", "host"}


# ---------------------------------------------------------------------- two processes, one store
CHILD = """
import json, sys, torch
from mini_transformer import SamplingParams, TransformerConfig, TransformerLM
from mini_transformer.engine import LLMEngine
from mini_transformer.engine.kv_connector import KVConnector
from mini_transformer.engine.kv_tiers import RedisTier
url, prompt, block_size = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
cfg = TransformerConfig(vocab_size=50, d_model=32, n_heads=4, n_layer=2, d_ff=64, max_seq_len=64, init_std=0.2,
                        pos_emb="rope", n_kv_heads=2, norm="rmsnorm", ffn="swiglu", bias=False)
connector = KVConnector([RedisTier(url)])
engine = LLMEngine(TransformerLM(cfg).eval(), block_size=block_size, num_blocks=64, kv_connector=connector)
out = engine.generate([prompt], SamplingParams(max_tokens=6), use_tqdm=False)[0]
connector.flush()
print(json.dumps({"output": out, "stats": engine.stats()}))
"""


def run_child(url: str, prompt: list[int], block_size: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, url, json.dumps(prompt), str(block_size)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_computes_only_the_tail(empty_redis):
    """Engine A (this process) serves a prompt; engine B (a child process, same seed, same weights)
    serves it again and computes only what follows the full blocks A stored."""
    block_size, prompt = 4, prompts_and_fillers()[0][1]  # 43 tokens: 10 full blocks before the last token
    model = make_model("llama")
    connector = KVConnector([RedisTier(empty_redis.url)])
    engine = LLMEngine(model, block_size=block_size, num_blocks=64, kv_connector=connector)
    a = dict(output=engine.generate([prompt], PARAMS, use_tqdm=False)[0], stats=engine.stats())
    engine.kv_connector.flush()
    b = run_child(empty_redis.url, prompt, block_size)
    shared = (len(prompt) - 1) // block_size
    assert a["output"] == b["output"] == reference(model, [prompt])[0]
    assert a["stats"]["prefill_tokens_computed"] == len(prompt) and b["stats"]["kv_store_lookup_blocks"] == shared
    assert b["stats"]["kv_store_blocks_loaded_redis"] == shared
    assert b["stats"]["prefill_tokens_computed"] == len(prompt) - shared * block_size


# ----------------------------------------------------------------------------- keys and checks
def test_other_weights_same_shapes_only_miss(empty_redis):
    prompts, fillers = prompts_and_fillers()
    first = small_engine(make_model("gpt2", seed=0), 4, KVConnector([RedisTier(empty_redis.url)]))
    serve_twice(first, prompts, fillers)
    other_model = make_model("gpt2", seed=1)
    other = small_engine(other_model, 4, KVConnector([RedisTier(empty_redis.url)]))
    assert other.kv_connector.fingerprint != first.kv_connector.fingerprint
    assert other.generate(prompts, PARAMS, use_tqdm=False) == reference(other_model, prompts)
    stats = other.stats()
    assert stats["kv_store_lookup_blocks"] > 0 and stats["kv_store_hit_blocks"] == 0
    assert stats["kv_store_verify_failures"] == 0, "other weights, other keys: not even a refused entry"


def test_a_colliding_or_foreign_entry_is_a_counted_miss(model, expected):
    """Put, under the key of each of a prompt's blocks, a value that is not that block: the same model's
    value of the next block (a key collision: right fingerprint, other tokens), then the same blocks
    saved by another model. Every one is refused, and the outputs stay the reference's."""
    prompts, _ = prompts_and_fillers()
    saver = small_engine(model, 4, KVConnector([HostTier(1 << 20)]))
    donor = small_engine(make_model("gpt2", seed=3), 4, KVConnector([HostTier(1 << 20)]))
    for engine in (saver, donor):
        engine.generate(prompts, PARAMS, use_tqdm=False)
        engine.kv_connector.flush()
    for source, shift in ((saver, 1), (donor, 0)):
        keys = source.kv_connector.keys(engine_sequence(prompts[0]), 8)
        values = source.kv_connector.tiers[0].get_many(keys)
        tier = HostTier(1 << 20)
        for key, value in zip(saver.kv_connector.keys(engine_sequence(prompts[0]), 8), values[shift:] + values[:shift],
                              strict=True):
            tier.put(key, value)
        engine = small_engine(model, 4, KVConnector([tier]))
        assert engine.generate(prompts, PARAMS, use_tqdm=False) == expected
        stats = engine.stats()
        assert stats["kv_store_verify_failures"] >= 1 and stats["kv_store_hit_blocks"] == 0


def engine_sequence(prompt):
    from mini_transformer.engine.sequence import Sequence

    return Sequence("probe", prompt, PARAMS, (), arrival=0, device=torch.device("cpu"))


def test_decode_block_checks_every_field():
    kv = torch.randn(2, 2, 4, 2, 8)
    value = encode_block(b"f" * 16, 4, [1, 2, 3, 4], kv)
    assert torch.equal(decode_block(value, b"f" * 16, [1, 2, 3, 4], kv.shape, kv.dtype), kv)
    assert decode_block(value, b"g" * 16, [1, 2, 3, 4], kv.shape, kv.dtype) is None  # other model
    assert decode_block(value, b"f" * 16, [1, 2, 3, 5], kv.shape, kv.dtype) is None  # other tokens
    assert decode_block(value, b"f" * 16, [1, 2, 3, 4], kv.shape, torch.float16) is None  # other layout
    for i in (0, 30, len(value) // 2, len(value) - 1):  # one flipped byte anywhere
        damaged = bytearray(value)
        damaged[i] ^= 0x10
        assert decode_block(bytes(damaged), b"f" * 16, [1, 2, 3, 4], kv.shape, kv.dtype) is None
    assert decode_block(value[:-1], b"f" * 16, [1, 2, 3, 4], kv.shape, kv.dtype) is None


def test_host_tier_evicts_least_recently_used_by_bytes():
    tier = HostTier(30)
    for key in (b"a", b"b", b"c"):
        tier.put(key, b"x" * 10)
    tier.get_many([b"a"])  # a is now the most recent
    tier.put(b"d", b"x" * 10)
    assert tier.get_many([b"a", b"b", b"c", b"d"]) == [b"x" * 10, None, b"x" * 10, b"x" * 10]
    assert tier.bytes_used == 30 and tier.evictions == 1 and not tier.put(b"e", b"x" * 31)


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://127.0.0.1", "redis://:6379", "redis://h:99999"])
def test_bad_store_urls_are_refused(url):
    with pytest.raises(ValueError, match="redis://HOST:PORT"):
        parse_redis_url(url)


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
