"""The KV connector against generate() alone: with a host tier, a Redis tier or both, with device-pool
evictions forcing loads, every greedy output is the reference's, token for token. A second engine in
another process computes only the tail after the blocks the first one stored. Another model's blocks
are never found; a collided, foreign, damaged, forged or replayed entry is a counted miss, never used,
and engines sharing a secret share their blocks. The Redis tests run a real redis-server (they skip
without it); the tiers' own behaviour and faults: test_engine_kv_tiers.py; one entry: test_engine_kv_entry.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from array import array

import pytest
import torch
from kv_store_support import (
    PARAMS,
    RedisServer,
    kv_block_bytes,
    make_model,
    prompts_and_fillers,
    reference,
    serve_twice,
    small_engine,
    value_bytes,
)

from mini_transformer.engine import EngineConfig, LLMEngine
from mini_transformer.engine.kv_connector import KVConnector
from mini_transformer.engine.kv_entry import DIGEST, decode_block, encode_block
from mini_transformer.engine.kv_tiers import HostTier, RedisTier


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
from mini_transformer.engine import EngineConfig, LLMEngine
from mini_transformer.engine.kv_connector import KVConnector
from mini_transformer.engine.kv_tiers import RedisTier
url, prompt, block_size = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
cfg = TransformerConfig(vocab_size=50, d_model=32, n_heads=4, n_layer=2, d_ff=64, max_seq_len=64, init_std=0.2,
                        pos_emb="rope", n_kv_heads=2, norm="rmsnorm", ffn="swiglu", bias=False)
connector = KVConnector([RedisTier(url)])
engine = LLMEngine(TransformerLM(cfg).eval(), EngineConfig(block_size=block_size, num_blocks=64),
                   kv_connector=connector)
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
    engine = LLMEngine(model, EngineConfig(block_size=block_size, num_blocks=64), kv_connector=connector)
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


# ------------------------------------------------------------------------------ signed entries
SECRET = b"the replicas' shared secret"


def signed_prompt_entries(model, tier):
    """The prompts served once by an engine signing with SECRET: `tier` holds their blocks."""
    prompts, _ = prompts_and_fillers()
    saver = small_engine(model, 4, KVConnector([tier], secret=SECRET))
    saver.generate(prompts, PARAMS, use_tqdm=False)
    saver.kv_connector.flush()
    return prompts, saver.kv_connector


def forged(value: bytes, key: bytes, how: str, model) -> bytes:
    """`value` changed as someone who can write to the store but lacks the secret would change it."""
    kv_bytes = kv_block_bytes(model, 4)
    head, body = value[:len(value) - DIGEST - kv_bytes], value[-DIGEST - kv_bytes:-DIGEST]
    kv = torch.frombuffer(bytearray(body), dtype=torch.float32)
    if how == "planted":  # the project's own encoder, no secret: another prompt's K/V under this key
        return encode_block(head[5:21], 4, array("q", head[29:]).tolist(), torch.randn(kv.shape), store_key=key)
    changed = (torch.zeros_like(kv) if how == "zeroed" else -kv).numpy().tobytes()
    return head + changed + hashlib.blake2b(head + changed, digest_size=DIGEST).digest()  # an unkeyed checksum


@pytest.mark.parametrize("how", ["zeroed", "negated", "planted", "wrong secret", "replayed"])
def test_forged_planted_and_replayed_entries_are_refused(model, expected, how):
    prompts, saver = signed_prompt_entries(model, HostTier(1 << 20))
    keys = saver.keys(engine_sequence(prompts[0]), 8)
    values = saver.tiers[0].get_many(keys)
    tier = HostTier(1 << 20)
    for i, (key, value) in enumerate(zip(keys, values, strict=True)):
        if how == "replayed":  # a real entry, under the key of the block after it
            tier.put(keys[(i + 1) % len(keys)], value)
        else:
            tier.put(key, forged(value, key, how, model) if how != "wrong secret" else value)
    engine = small_engine(model, 4, KVConnector([tier], secret=b"another secret, as long" if how == "wrong secret"
                                                else SECRET))
    assert engine.generate(prompts, PARAMS, use_tqdm=False) == expected
    stats = engine.stats()
    assert stats["kv_store_verify_failures"] >= 1 and stats["kv_store_hit_blocks"] == 0


def test_a_replayed_block_with_the_same_tokens_is_refused(model):
    """The same four tokens after two different prefixes: their K/V differ, their token ids do not. Only
    the MAC over the store key tells one's entry from the other's."""
    block, gen = [7, 8, 9, 10], torch.Generator().manual_seed(5)
    first = torch.randint(0, 50, (8,), generator=gen).tolist() + block + [1, 2]
    second = torch.randint(0, 50, (8,), generator=gen).tolist() + block + [3, 4]
    tier = HostTier(1 << 20)
    saver = small_engine(model, 4, KVConnector([tier], secret=SECRET))
    saver.generate([first, second[:8] + [0, 0, 0, 0, 5]], PARAMS, use_tqdm=False)  # second's blocks 0, 1
    saver.kv_connector.flush()
    first_key, second_key = (saver.kv_connector.keys(engine_sequence(p), 3)[2] for p in (first, second))
    tier.put(second_key, tier.get_many([first_key])[0])  # first's block 2 under second's key
    engine = small_engine(model, 4, KVConnector([tier], secret=SECRET))
    assert engine.generate([second], PARAMS, use_tqdm=False) == reference(model, [second])
    stats = engine.stats()
    assert stats["kv_store_verify_failures"] == 1 and stats["kv_store_hit_blocks"] == 2


def test_engines_sharing_the_secret_share_prefixes(model, expected):
    prompts, saver = signed_prompt_entries(model, HostTier(1 << 20))
    engine = small_engine(model, 4, KVConnector(saver.tiers, secret=SECRET))
    assert engine.generate(prompts, PARAMS, use_tqdm=False) == expected
    stats = engine.stats()
    assert stats["kv_store_hit_blocks"] > 0 and stats["kv_store_verify_failures"] == 0


def test_signed_entries_through_redis(model, expected, empty_redis):
    """A replica with the secret reads what another one signed into Redis; an entry planted there with
    the project's own encoder but no secret is refused."""
    prompts, saver = signed_prompt_entries(model, RedisTier(empty_redis.url))
    engine = small_engine(model, 4, KVConnector([RedisTier(empty_redis.url)], secret=SECRET))
    assert engine.generate(prompts, PARAMS, use_tqdm=False) == expected
    assert engine.stats()["kv_store_hit_blocks"] > 0
    client = empty_redis.client()
    for key in client.keys("mtkv:*"):
        client.set(key, forged(client.get(key), key, "planted", model))
    engine = small_engine(model, 4, KVConnector([RedisTier(empty_redis.url)], secret=SECRET))
    assert engine.generate(prompts, PARAMS, use_tqdm=False) == expected
    stats = engine.stats()
    assert stats["kv_store_verify_failures"] >= 1 and stats["kv_store_hit_blocks"] == 0


# ------------------------------------------------------------- prefill/decode across servers
@pytest.mark.parametrize("tier", ["host", "redis"])
def test_wait_saved_then_stored_run_sees_every_full_block(tier, empty_redis):
    """wait_saved returns once the writer has written every queued block; stored_run then counts the
    prompt's full blocks in the tier (an unbroken run from the start; a prompt never saved has none)."""
    block_size, prompt = 4, prompts_and_fillers()[0][1]  # 43 tokens: 10 full blocks
    tiers = [HostTier(1 << 22)] if tier == "host" else [RedisTier(empty_redis.url)]
    connector = KVConnector(tiers)
    engine = LLMEngine(make_model("llama"), EngineConfig(block_size=block_size, num_blocks=64),
                       kv_connector=connector)
    engine.generate([prompt], PARAMS, use_tqdm=False)
    assert connector.wait_saved(timeout=30)
    assert connector.counters.blocks_saved >= len(prompt) // block_size
    assert connector.stored_run(prompt, 10) == 10
    assert connector.stored_run(prompt[:20] + [(prompt[20] + 1) % 50] + prompt[21:], 10) == 5  # block 5 differs
    assert connector.stored_run([(t + 1) % 50 for t in prompt], 10) == 0
    assert tiers[0].has_many([b"no such key"]) == [False]
