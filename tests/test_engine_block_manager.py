"""BlockManager: reference counts, no leaked block, LRU eviction order, the hash-collision guard and the
fully cached prompt; checked on the manager alone and through the engine against generate()."""

import random

import pytest
import torch

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM, generate
from mini_transformer.engine import EngineConfig, LLMEngine, block_manager
from mini_transformer.engine.block_manager import BlockManager
from mini_transformer.engine.sequence import Sequence

BS = 4


def seq(tokens, request_id="r", max_tokens=4):
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens), (), 0, torch.device("cpu"))


def run_prompt(manager, s):
    """Admit s with whatever the cache holds and allocate the rest of its prompt (as the scheduler does)."""
    cached = manager.find_cached_blocks(s)
    manager.admit(s, cached)
    assert manager.allocate_slots(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    return cached


def check_invariants(manager, holders):
    """Every block is either free (ref 0, on the free list) or held exactly ref_count times."""
    held = {}
    for s in holders:
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    for block in manager.blocks:
        assert block.ref_count == held.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in manager.free_block_ids)
    for block_hash, block_id in manager.hash_to_block_id.items():
        assert manager.blocks[block_id].block_hash == block_hash


def test_shared_prefix_is_reference_counted_and_freed_by_the_last_holder():
    manager = BlockManager(num_blocks=10, block_size=BS)
    a = seq(list(range(10)), "a")
    run_prompt(manager, a)
    b = seq(list(range(8)) + [40, 41, 42], "b")
    assert run_prompt(manager, b) == a.block_table[:2]  # two full blocks shared
    assert [manager.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert manager.num_shared_blocks == 2 and manager.num_blocks_in_use == 4
    check_invariants(manager, [a, b])
    manager.free(a)
    assert manager.num_blocks_in_use == 3  # the shared blocks stay: b still holds them
    check_invariants(manager, [b])
    manager.free(b)
    assert manager.num_blocks_in_use == 0
    check_invariants(manager, [])


def test_freed_blocks_keep_their_content_and_are_evicted_least_recently_used_first():
    manager = BlockManager(num_blocks=5, block_size=BS)
    a, b = seq(list(range(8)) + [0], "a"), seq(list(range(20, 28)) + [0], "b")  # 2 full blocks + 1 token each
    run_prompt(manager, a)
    a_blocks = list(a.block_table)
    manager.free(a)
    run_prompt(manager, b)  # a's partly filled block (nothing cached) and the two unused ones
    assert not set(b.block_table) & set(a_blocks[:2]), "b evicted a's cached blocks while others were free"
    b_blocks = list(b.block_table)
    manager.free(b)
    # free list, oldest first: b's partial block, then a's full blocks (tail first), then b's (tail first)
    c = seq(list(range(50, 54)) + [0], "c")
    run_prompt(manager, c)
    assert c.block_table == [b_blocks[2], a_blocks[1]]  # a's tail is the least recently used cached block
    assert manager.find_cached_blocks(seq(list(range(8)) + [0])) == a_blocks[:1]  # a's head still cached
    assert manager.find_cached_blocks(seq(list(range(20, 28)) + [0])) == b_blocks[:2]
    check_invariants(manager, [c])


def test_a_hash_collision_is_caught_by_the_token_guard(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block_tokens", lambda parent, tokens: 7)  # everything collides
    manager = BlockManager(num_blocks=10, block_size=BS)
    run_prompt(manager, seq([1, 2, 3, 4, 5], "a"))
    other = seq([9, 9, 9, 9, 5], "b")
    assert manager.find_cached_blocks(other) == []  # same hash, other tokens: no reuse
    assert manager.find_cached_blocks(seq([1, 2, 3, 4, 6], "c")) != []  # the real match still hits


def test_a_fully_cached_prompt_still_computes_its_last_token():
    manager = BlockManager(num_blocks=10, block_size=BS)
    run_prompt(manager, seq(list(range(9)), "a"))
    assert len(manager.find_cached_blocks(seq(list(range(9)), "b"))) == 2  # 8 of 9 cached: 1 computed
    assert len(manager.find_cached_blocks(seq(list(range(8)), "c"))) == 1  # all 8 cached: recompute a block


def tiny_model():
    cfg = TransformerConfig(vocab_size=30, d_model=32, n_heads=4, n_layer=2, d_ff=64, max_seq_len=48, init_std=0.2)
    torch.manual_seed(0)
    return TransformerLM(cfg).eval()


def test_collision_guard_keeps_engine_outputs_exact(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block_tokens", lambda parent, tokens: 7)
    model = tiny_model()
    prompts = [[1] * 9, [2] * 9, [1] * 8 + [3]]
    engine = LLMEngine(model, EngineConfig(block_size=BS, num_blocks=30))
    got = engine.generate(prompts, SamplingParams(max_tokens=5), use_tqdm=False)
    assert got == [generate(model, torch.tensor([p]), 5)[0].tolist() for p in prompts]


def test_fully_cached_prompt_through_the_engine():
    model = tiny_model()
    engine = LLMEngine(model, EngineConfig(block_size=BS, num_blocks=30))
    prompt = list(range(1, 13))  # 3 full blocks
    first = engine.generate([prompt], SamplingParams(max_tokens=3), use_tqdm=False)
    computed = engine.stats()["prefill_tokens_computed"]
    again = engine.generate([prompt], SamplingParams(max_tokens=3), use_tqdm=False)
    stats = engine.stats()
    assert again == first
    assert stats["prefill_tokens_computed"] - computed == BS  # the last block again, for the logits
    assert stats["prefix_cache_hit_tokens"] == 8


def test_no_block_leaks_after_aborts_and_preemptions():
    model = tiny_model()
    rng = random.Random(0)
    engine = LLMEngine(model, EngineConfig(block_size=2, num_blocks=14, max_num_batched_tokens=9, max_num_seqs=4))
    live = []
    for _ in range(60):
        if rng.random() < 0.5:
            prompt = [rng.randrange(30) for _ in range(rng.randint(1, 10))]
            if rng.random() < 0.5:
                prompt = [5, 6, 7, 8] + prompt  # a shared prefix now and then
            live.append(engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 8))))
        if live and rng.random() < 0.15:
            engine.abort(live.pop(rng.randrange(len(live))))
        engine.step()
        check_invariants(engine.block_manager, engine.scheduler.running)
        assert not any(s.block_table for s in engine.scheduler.waiting)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["requests_aborted"] > 0
    assert stats["blocks_in_use"] == 0
    check_invariants(engine.block_manager, [])


@pytest.mark.parametrize("caching", [True, False])
def test_caching_off_registers_nothing(caching):
    manager = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=caching)
    run_prompt(manager, seq(list(range(9))))
    assert bool(manager.hash_to_block_id) == caching


def test_block_table_rows_follow_each_sequence_and_grow_past_their_count():
    """The runner's persistent BlockTable: appended blocks land in the row, a new list (re-admission)
    rewrites it, and more live sequences than rows grow the array (the row numbers stay valid)."""
    from types import SimpleNamespace

    from mini_transformer.engine.block_table import BlockTable

    table = BlockTable(max_blocks_per_seq=4, rows=1)
    a, b = SimpleNamespace(request_id="a", block_table=[3]), SimpleNamespace(request_id="b", block_table=[5, 6])
    rows = table.rows_for([a, b])  # two sequences, one row: it grows
    a.block_table.append(7)
    rows = table.rows_for([a, b])
    assert table.table[rows][:, :2].tolist() == [[3, 7], [5, 6]]
    a.block_table = [9]  # preempted and admitted again: a new list
    assert table.table[table.rows_for([a])][0, 0] == 9
    table.release("a")
    c = SimpleNamespace(request_id="c", block_table=[1])
    assert table.rows_for([c]).tolist() == [rows[0]]  # a's row is reused
