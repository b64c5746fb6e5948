"""LLMEngine.snapshot() against the engine's actual state after a few steps: the queues, each request's
block table, the pool's reference counts (recomputed from the block tables), and stats()."""

import dataclasses

import pytest
import torch

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM
from mini_transformer.engine import EngineConfig, EngineSnapshot, LLMEngine

VOCAB = 40


@pytest.fixture(scope="module")
def model():
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, n_layer=1, d_ff=32,
                            max_seq_len=64, pos_emb="rope", init_std=0.2)
    torch.manual_seed(0)
    return TransformerLM(cfg).eval()


def busy_engine(model) -> LLMEngine:
    """Four requests sharing a 12-token prefix, a pool and a max_num_seqs small enough that one waits."""
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=24, max_num_seqs=3, max_num_batched_tokens=16))
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
    for n in (3, 6, 1, 9):
        engine.add_request(prefix + torch.randint(0, VOCAB, (n,), generator=gen).tolist(),
                           SamplingParams(max_tokens=6))
    return engine


def check_against_engine(snap: EngineSnapshot, engine: LLMEngine) -> None:
    scheduler, manager, stats = engine.scheduler, engine.block_manager, engine.stats()
    assert [r.request_id for r in snap.running] == [s.request_id for s in scheduler.running]
    assert [r.request_id for r in snap.waiting] == [s.request_id for s in scheduler.waiting]
    for view, seq in zip(snap.running + snap.waiting, list(scheduler.running) + list(scheduler.waiting), strict=True):
        assert view.status == seq.status.value
        assert (view.prompt_tokens, view.output_tokens, view.max_tokens) == (
            len(seq.prompt_token_ids), len(seq.output_token_ids), seq.params.max_tokens)
        assert (view.computed_tokens, view.cached_tokens) == (seq.num_computed_tokens, seq.num_cached_tokens)
        assert list(view.block_table) == seq.block_table
    held = [0] * engine.num_blocks  # the reference counts, recomputed from the requests' block tables
    for view in snap.running + snap.waiting:
        for block_id in view.block_table:
            held[block_id] += 1
    assert list(snap.block_ref_counts) == held
    assert snap.blocks_in_use == sum(n > 0 for n in held) == stats["blocks_in_use"]
    assert snap.free_blocks == engine.num_blocks - stats["blocks_in_use"]
    assert snap.shared_blocks == sum(n > 1 for n in held) == stats["shared_blocks"]
    assert list(snap.block_cached) == [block.block_hash is not None for block in manager.blocks]
    assert sum(snap.block_cached) == stats["cached_blocks"]
    assert (snap.num_running, snap.num_waiting) == (stats["num_running"], stats["num_waiting"])
    assert dict(snap.stats) == stats and snap.prefix_cache_hit_tokens == stats["prefix_cache_hit_tokens"]
    hit, computed = stats["prefix_cache_hit_tokens"], stats["prefill_tokens_computed"]
    assert snap.prefix_cache_hit_rate == (hit / (hit + computed) if hit + computed else 0.0)


def test_snapshot_equals_the_engine_state_after_each_step(model):
    engine = busy_engine(model)
    check_against_engine(engine.snapshot(), engine)  # before any step: everything waits
    seen_waiting = seen_shared = False
    for _ in range(40):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        snap = engine.snapshot()
        check_against_engine(snap, engine)
        seen_waiting |= snap.num_running > 0 and snap.num_waiting > 0
        seen_shared |= snap.shared_blocks > 0
    assert not engine.has_unfinished_requests()
    assert seen_waiting and seen_shared  # the workload did show a queue and a shared prefix
    final = engine.snapshot()
    assert final.running == final.waiting == () and final.blocks_in_use == 0
    assert final.prefix_cache_hit_tokens > 0 and 0 < final.prefix_cache_hit_rate < 1


def test_a_snapshot_is_frozen_and_does_not_follow_the_engine(model):
    engine = busy_engine(model)
    engine.step()
    snap = engine.snapshot()
    running, ref_counts, steps = snap.running, snap.block_ref_counts, snap.stats["steps"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.num_blocks = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.running[0].block_table = ()
    with pytest.raises(TypeError):
        snap.stats["steps"] = 0
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # runs everything to the end
    assert snap.running == running and snap.block_ref_counts == ref_counts and snap.stats["steps"] == steps
    assert engine.snapshot().stats["steps"] > steps
