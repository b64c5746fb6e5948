"""KV events (engine/kv_events.py): the wire format decodes with a msgspec schema mirroring vLLM's event
structs; the events, replayed by a subscriber, rebuild exactly the prefix cache the engine holds after
every step (stores, evictions, a reset); the ZeroMQ publisher numbers its batches, answers replay
requests, and drops (and counts) a batch rather than ever blocking the engine thread."""

from __future__ import annotations

import random
import socket
import threading
import time

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from support import small_lm

from mini_transformer import SamplingParams
from mini_transformer.engine import EngineConfig, LLMEngine, kv_events
from mini_transformer.engine.kv_events import HASH_MASK, KVEventPublisher, encode_batch

TIMEOUT_S = 10.0
BS = 4


# vLLM's structs (vllm/distributed/kv_events.py): the batch is array-like, each event a map tagged with its
# class name under "type"; an int or bytes names a block
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
U64 = st.integers(0, HASH_MASK)
SIGNED = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=50, deadline=None)
@given(parent=st.none() | SIGNED, hashes=st.lists(SIGNED, min_size=1, max_size=4), bs=st.integers(1, 8),
       removed=st.lists(SIGNED, min_size=1, max_size=3), data=st.data())
def test_the_encoding_round_trips_through_vllms_schema(parent, hashes, bs, removed, data):
    tokens = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=bs * len(hashes), max_size=bs * len(hashes)))
    events = [("stored", parent, hashes, tokens), ("removed", removed), ("cleared",)]
    batch = DECODER.decode(encode_batch(12.5, events, bs))
    assert batch.ts == 12.5 and batch.data_parallel_rank is None
    stored, gone, cleared = batch.events
    assert stored == BlockStored(block_hashes=[h % 2**64 for h in hashes],
                                 parent_block_hash=None if parent is None else parent % 2**64, token_ids=tokens,
                                 block_size=bs, lora_id=None, medium="GPU", lora_name=None)
    assert gone == BlockRemoved(block_hashes=[h % 2**64 for h in removed], medium="GPU")
    assert cleared == AllBlocksCleared()


class Collector:
    """Stands in for the publisher: keeps each step's batch."""

    def __init__(self):
        self.batches: list[list[tuple]] = []

    def publish(self, events):
        if events:
            self.batches.append(list(events))


def replay(batches, view=None):
    """A subscriber's view of the cache from the events: {wire hash: token ids}."""
    view = {} if view is None else view
    for batch in batches:
        for event in DECODER.decode(encode_batch(0.0, batch, BS)).events:
            if isinstance(event, AllBlocksCleared):
                view.clear()
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    del view[h]  # a removal always names a block the subscriber was told about
            else:
                for i, h in enumerate(event.block_hashes):
                    view[h] = tuple(event.token_ids[i * BS:(i + 1) * BS])
    return view


def cached(engine):
    blocks = engine.block_manager.blocks
    return {h & HASH_MASK: blocks[b].token_ids for h, b in engine.block_manager.hash_to_block_id.items()}



def test_replayed_events_rebuild_the_engines_prefix_cache_after_every_step():
    config = EngineConfig(block_size=BS, num_blocks=12, max_num_seqs=3)
    engine = LLMEngine(small_lm(vocab_size=13, max_seq_len=64), config)
    engine.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)  # cached before: reset
    collector = Collector()
    engine.publish_kv_events(collector)
    assert collector.batches == [[("cleared",)]] and not engine.block_manager.hash_to_block_id
    collector.batches.clear()
    rng, view, kinds = random.Random(0), {}, set()
    shared = [rng.randrange(13) for _ in range(9)]
    for i in range(12):  # shared prefixes, and a pool small enough that blocks get evicted
        prompt = shared[:rng.randrange(4, 10)] + [rng.randrange(13) for _ in range(rng.randrange(1, 8))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 6), temperature=0.0))
        if i % 3 == 2:
            while engine.has_unfinished_requests():
                engine.step()
                kinds |= {e[0] for b in collector.batches for e in b}
                view = replay(collector.batches, view)
                collector.batches.clear()
                assert view == cached(engine)
    assert kinds == {"stored", "removed"}
    assert engine.reset_prefix_cache()
    assert collector.batches == [[("cleared",)]]
    assert replay(collector.batches, view) == {} == cached(engine)


def test_an_eviction_is_published_as_block_removed():
    engine = LLMEngine(small_lm(vocab_size=13, max_seq_len=64), EngineConfig(block_size=BS, num_blocks=4))
    collector = Collector()
    engine.publish_kv_events(collector)
    engine.generate([[1] * 9], SamplingParams(max_tokens=1), use_tqdm=False)  # two full blocks cached
    first = cached(engine)
    engine.generate([[2] * 13], SamplingParams(max_tokens=1), use_tqdm=False)  # needs all four blocks
    removed = {h for b in collector.batches for e in b if e[0] == "removed" for h in e[1]}
    assert {h & HASH_MASK for h in removed} == set(first)
    assert replay(collector.batches) == cached(engine)


def test_blocks_are_published_when_scheduled_before_the_forward_pass_fills_them():
    """A router must learn of a prefix while it is being computed: requests for it that arrive during a
    long prefill should follow it to this replica rather than compute it again on another."""
    engine = LLMEngine(small_lm(vocab_size=13, max_seq_len=64),
                       EngineConfig(block_size=BS, num_blocks=16, max_num_batched_tokens=8))
    collector = Collector()
    engine.publish_kv_events(collector)
    seen_by_router, execute = [], engine.runner.execute_model

    def execute_model(scheduled):
        seen_by_router.append(replay(collector.batches))  # what a subscriber knows as the pass starts
        return execute(scheduled)

    engine.runner.execute_model = execute_model
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 5]  # three full blocks, prefilled in two chunks of 8
    engine.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    blocks = [tuple(prompt[i:i + BS]) for i in range(0, 12, BS)]
    assert [sorted(v.values()) for v in seen_by_router[:2]] == [blocks[:2], blocks]


def test_publish_kv_events_refuses_an_engine_with_requests_in_flight():
    engine = LLMEngine(small_lm(vocab_size=13, max_seq_len=64), EngineConfig(block_size=BS, num_blocks=8))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="no request in flight"):
        engine.publish_kv_events(Collector())


def free_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def subscribed(endpoint: str, publisher: KVEventPublisher):
    """A SUB socket that has surely joined (PUB drops what is sent before): probe batches until one comes."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    deadline = time.monotonic() + TIMEOUT_S
    while not sub.poll(50):
        assert time.monotonic() < deadline, "the subscriber never joined"
        publisher.publish([("cleared",)])
    while sub.poll(200):
        sub.recv_multipart()
    return sub


def receive(sub) -> tuple[int, KVEventBatch]:
    assert sub.poll(int(TIMEOUT_S * 1000)), "no event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    assert topic == b""
    return int.from_bytes(seq, "big"), DECODER.decode(payload)


def test_the_publisher_numbers_batches_and_drops_when_its_queue_is_full(monkeypatch):
    release, encoding = threading.Event(), threading.Event()
    real = kv_events.encode_batch

    def held(ts, events, block_size):  # the publisher thread stalls here, as on a slow network
        encoding.set()
        release.wait(TIMEOUT_S)
        return real(ts, events, block_size)

    endpoint = free_endpoint()
    publisher = KVEventPublisher(endpoint, BS, max_queue=1)
    try:
        sub = subscribed(endpoint, publisher)
        monkeypatch.setattr(kv_events, "encode_batch", held)
        first = publisher.published
        publisher.publish([("removed", [1])])
        assert encoding.wait(TIMEOUT_S)
        publisher.publish([("removed", [2])])  # fills the queue
        publisher.publish([("removed", [3])])  # dropped, and counted: the engine thread never waits
        publisher.publish([])  # an empty step sends nothing and uses no number
        assert publisher.dropped == 1
        release.set()
        (s1, b1), (s2, b2) = receive(sub), receive(sub)
        assert s2 == s1 + 1 and [b1.events[0].block_hashes, b2.events[0].block_hashes] == [[1], [2]]
        publisher.publish([("removed", [4])])
        s4, b4 = receive(sub)
        assert s4 == s2 + 2 and b4.events[0].block_hashes == [4]  # the gap shows the lost batch
        deadline = time.monotonic() + TIMEOUT_S
        while publisher.published < first + 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        release.set()
        publisher.close()


def test_the_replay_socket_resends_kept_batches_from_a_sequence_number():
    endpoint, replay_endpoint = free_endpoint(), free_endpoint()
    publisher = KVEventPublisher(endpoint, BS, replay_endpoint=replay_endpoint, replay_batches=3)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        for i in range(5):
            publisher.publish([("removed", [i])])
        deadline = time.monotonic() + TIMEOUT_S
        while publisher.published < 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", (3).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(int(TIMEOUT_S * 1000)), "the replay did not answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == kv_events.END_SEQ:
                break
            got.append((int.from_bytes(seq, "big"), DECODER.decode(payload).events[0].block_hashes))
        assert got == [(3, [3]), (4, [4])]  # kept: the last three batches (2, 3, 4); asked from 3 on
    finally:
        dealer.close(linger=0)
        publisher.close()


def test_a_taken_endpoint_fails_at_startup():
    endpoint = free_endpoint()
    publisher = KVEventPublisher(endpoint, BS)
    try:
        with pytest.raises(OSError, match="cannot bind KV events"):
            KVEventPublisher(endpoint, BS)
        with pytest.raises(OSError, match="cannot bind KV events"):
            KVEventPublisher("tcp://no-port", BS)
    finally:
        publisher.close()
