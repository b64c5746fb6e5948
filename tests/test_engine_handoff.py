"""A prefilled request handed from one engine to another (prefill_for_handoff -> adopt_prefilled), in one
process: the decode engine's outputs equal one LLMEngine's, token for token."""

import dataclasses

import pytest
import torch

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM
from mini_transformer.engine import EngineConfig, KVHandoff, LLMEngine

VOCAB = 50
PARAMS = {"greedy": SamplingParams(max_tokens=7),
          "seeded": SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=5)}


@pytest.fixture(scope="module")
def model():
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, n_layer=2, d_ff=48,
                            max_seq_len=64, pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False, init_std=0.3)
    torch.manual_seed(0)
    return TransformerLM(cfg).eval()


def prompts():
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 13, 1, 22)]


def disaggregated(model, params, prefill_block_size=4, decode_block_size=8, max_num_batched_tokens=512):
    """Prefill every prompt on one engine, decode them all together on another (other block tables)."""
    prefill = LLMEngine(model, EngineConfig(block_size=prefill_block_size, num_blocks=40,
                                            max_num_batched_tokens=max_num_batched_tokens))
    decode = LLMEngine(model, EngineConfig(block_size=decode_block_size, num_blocks=120))
    outputs, handoffs = {}, []
    for prompt in prompts():
        handoff = prefill.prefill_for_handoff(prompt, params)
        handoffs.append(handoff)
        outputs[decode.adopt_prefilled(handoff, params)] = [handoff.first_token]
    while decode.has_unfinished_requests():
        for out in decode.step():
            outputs[out.request_id] += out.new_token_ids
    assert prefill.stats()["blocks_in_use"] == 0 and decode.stats()["blocks_in_use"] == 0
    return list(outputs.values()), handoffs


@pytest.mark.parametrize("which", sorted(PARAMS))
def test_handoff_equals_one_engine(model, which):
    reference = LLMEngine(model,
                          EngineConfig(block_size=4, num_blocks=40)).generate(prompts(), PARAMS[which], use_tqdm=False)
    got, handoffs = disaggregated(model, PARAMS[which])
    assert got == reference
    cfg = model.config
    for handoff, prompt in zip(handoffs, prompts(), strict=True):
        assert isinstance(handoff, KVHandoff) and handoff.prompt_token_ids == tuple(prompt) and not handoff.finished
        assert handoff.kv.shape == (2, cfg.n_layer, len(prompt), cfg.n_kv_heads, cfg.d_head)
        assert handoff.kv_bytes == 2 * cfg.n_layer * len(prompt) * cfg.n_kv_heads * cfg.d_head * 4


def test_handoff_after_a_chunked_prefill(model):
    """A prompt prefilled over several steps (a budget of 4 tokens) hands over the same K/V."""
    reference = LLMEngine(model, EngineConfig(block_size=4,
                                              num_blocks=40)).generate(prompts(), PARAMS["greedy"], use_tqdm=False)
    got, _ = disaggregated(model, PARAMS["greedy"], prefill_block_size=2, decode_block_size=1,
                           max_num_batched_tokens=4)
    assert got == reference


def test_adopted_kv_sits_in_the_decode_pool(model):
    prefill = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20))
    decode = LLMEngine(model, EngineConfig(block_size=16, num_blocks=20))
    handoff = prefill.prefill_for_handoff(prompts()[3], PARAMS["greedy"])
    request_id = decode.adopt_prefilled(handoff, PARAMS["greedy"], request_id="moved")
    assert request_id == "moved"
    view = decode.snapshot().running[0]
    assert view.request_id == "moved" and view.computed_tokens == 22 and view.output_tokens == 1
    assert torch.equal(decode.runner.copy_kv_out(list(view.block_table), 22), handoff.kv)


def test_a_request_done_at_its_first_token_hands_over_no_kv(model):
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20))
    handoff = engine.prefill_for_handoff(prompts()[0], SamplingParams(max_tokens=1))
    assert handoff.finished and handoff.finish_reason == "length" and handoff.kv is None and handoff.kv_bytes == 0
    with pytest.raises(ValueError, match="nothing to decode"):
        LLMEngine(model,
                  EngineConfig(block_size=4, num_blocks=20)).adopt_prefilled(handoff, SamplingParams(max_tokens=1))
    assert engine.stats()["blocks_in_use"] == 0


def test_bad_handoffs_are_refused_and_change_nothing(model):
    prefill = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20))
    params = PARAMS["greedy"]
    handoff = prefill.prefill_for_handoff(prompts()[1], params)
    decode = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20))
    bad = [
        ("a dict", TypeError, "KVHandoff"),
        (dataclasses.replace(handoff, kv=handoff.kv[:, :, :-1]), ValueError, "shape"),
        (dataclasses.replace(handoff, kv=handoff.kv.double()), ValueError, "dtype"),
        (dataclasses.replace(handoff, first_token=VOCAB), ValueError, "first_token"),
        (dataclasses.replace(handoff, generator_state=torch.zeros(3, dtype=torch.uint8)), ValueError, "seed"),
    ]
    for wrong, error, message in bad:
        with pytest.raises(error, match=message):
            decode.adopt_prefilled(wrong, params)
    small = LLMEngine(model, EngineConfig(block_size=4, num_blocks=5))  # room for the request's 13 + 7 - 1 tokens, once
    small.adopt_prefilled(handoff, params)
    with pytest.raises(RuntimeError, match="no room"):
        small.adopt_prefilled(handoff, params)  # its 13 prompt tokens need 4 blocks; 1 is free
    assert len(small.requests) == 1 and small.stats()["blocks_in_use"] == 4
    assert not decode.has_unfinished_requests() and decode.stats()["blocks_in_use"] == 0
    with pytest.raises(ValueError, match="num_tokens"):
        decode.kv_buffer(0)
    assert decode.kv_buffer(13).shape == handoff.kv.shape and decode.kv_buffer(13).dtype == handoff.kv.dtype
    decode.add_request([1, 2], params)
    with pytest.raises(RuntimeError, match="no other requests"):
        decode.prefill_for_handoff([3, 4], params)  # the other request's outputs would be lost
    assert list(decode.requests) == ["0"]


def test_door_checks_name_the_field_and_leave_the_engine_as_it_was(model):
    """A seeded request's generator state must fit this engine's generator (setting a wrong one fails
    only after the request holds blocks); kv must be a tensor; the prompt is checked like add_request's."""
    params = PARAMS["seeded"]
    handoff = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20)).prefill_for_handoff(prompts()[1], params)
    decode = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20))
    bad = [
        (dataclasses.replace(handoff, generator_state=torch.zeros(3, dtype=torch.uint8)), ValueError,
         "generator_state is torch.uint8 \\(3,\\)"),
        (dataclasses.replace(handoff, generator_state=handoff.generator_state.tolist()), ValueError,
         "generator_state is list"),
        (dataclasses.replace(handoff, kv=handoff.kv.numpy()), ValueError, "kv_handoff.kv is ndarray"),
        (dataclasses.replace(handoff, prompt_token_ids=None), TypeError, "prompt_token_ids"),
        (dataclasses.replace(handoff, prompt_token_ids=(VOCAB,)), ValueError, "prompt_token_ids"),
    ]
    for wrong, error, message in bad:
        with pytest.raises(error, match=message):
            decode.adopt_prefilled(wrong, params)
        assert not decode.requests and decode.stats()["blocks_in_use"] == 0
        assert decode.stats()["cached_blocks"] == 0


def test_a_failed_adoption_leaves_no_request_no_block_and_no_cached_prefix(model, monkeypatch):
    """The K/V copy fails after the request got its blocks (and they entered the prefix cache): all of it
    is undone, and the same handoff then adopts and decodes as one engine would."""
    params = PARAMS["greedy"]
    prompt = prompts()[3]
    handoff = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20)).prefill_for_handoff(prompt, params)
    decode = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20))

    def out_of_memory(block_table, kv):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(decode.runner, "copy_kv_in", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        decode.adopt_prefilled(handoff, params)
    stats = decode.stats()
    assert not decode.requests and stats["blocks_in_use"] == 0 and stats["cached_blocks"] == 0
    monkeypatch.undo()
    request_id = decode.adopt_prefilled(handoff, params)
    completion = [handoff.first_token]
    while decode.has_unfinished_requests():
        completion += [t for out in decode.step() if out.request_id == request_id for t in out.new_token_ids]
    reference = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20)).generate([prompt], params, use_tqdm=False)
    assert [completion] == reference


def test_the_prefill_engine_lets_go_of_the_request_however_it_ends(model, monkeypatch):
    """Handed off: counted as such, not as an abort. The K/V copy failing: the request is aborted, its
    blocks are free, and the next handoff finds the engine empty."""
    params = PARAMS["greedy"]
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20))
    engine.prefill_for_handoff(prompts()[1], params)
    stats = engine.stats()
    assert (stats["requests_handed_off"], stats["requests_aborted"], stats["requests_finished"]) == (1, 0, 0)
    engine.prefill_for_handoff(prompts()[0], SamplingParams(max_tokens=1))  # done at its first token
    assert (engine.stats()["requests_handed_off"], engine.stats()["requests_finished"]) == (1, 1)

    def out_of_memory(block_table, num_tokens):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.runner, "copy_kv_out", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.prefill_for_handoff(prompts()[3], params)
    assert not engine.requests and engine.stats()["blocks_in_use"] == 0
    assert engine.stats()["requests_aborted"] == 1
    monkeypatch.undo()
    again = engine.prefill_for_handoff(prompts()[3], params)  # its prefix comes from the cache this time
    fresh = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20)).prefill_for_handoff(prompts()[3], params)
    assert again.first_token == fresh.first_token
    torch.testing.assert_close(again.kv, fresh.kv, atol=1e-5, rtol=1e-5)  # other batch shapes: rounding


def test_an_adopted_prompt_serves_the_decode_engines_prefix_cache(model):
    """The adopted blocks enter the decode pool's prefix cache: a later local request with the same
    prompt reuses them (shared while both run, freed by the last holder) and still equals one engine."""
    params, prompt = PARAMS["greedy"], prompts()[3]  # 22 tokens: 5 full blocks of 4
    handoff = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20)).prefill_for_handoff(prompt, params)
    decode = LLMEngine(model, EngineConfig(block_size=4, num_blocks=40))
    adopted = decode.adopt_prefilled(handoff, params)
    local = decode.add_request(prompt, params)
    outputs = {adopted: [handoff.first_token], local: []}
    first_step = True
    while decode.has_unfinished_requests():
        for out in decode.step():
            outputs[out.request_id] += out.new_token_ids
        if first_step:  # the local request was admitted beside the adopted one, on its blocks
            assert decode.stats()["prefix_cache_hit_tokens"] == 20 and decode.snapshot().shared_blocks == 5
            first_step = False
    reference = LLMEngine(model,
                          EngineConfig(block_size=4, num_blocks=20)).generate([prompt], params, use_tqdm=False)[0]
    assert outputs[adopted] == outputs[local] == reference
    assert decode.stats()["blocks_in_use"] == 0
