"""engine/sampler.py against the one-row reference (inference/sampling.py's sample_next, same generator
draws), the penalties against their definitions computed by hand, and the engine's logprobs against
log_softmax of one full float64 forward of the model (chunked prefill and prefix caching included)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import VOCAB, alone, make_model, make_prompts
from test_sampling import extreme_params_strategy

from mini_transformer import SamplingParams
from mini_transformer.engine import EngineConfig, InvalidRequest, LLMEngine
from mini_transformer.engine.batch_plan import BatchPlan
from mini_transformer.engine.sampler import Sampler, penalise
from mini_transformer.engine.sequence import Sequence, TokenLogprob
from mini_transformer.inference.sampling import SAMPLING_EPS, sample_next

V = 40
STOPS = (3, 5)


def sequence(params, prompt, output=(), request_id="r"):
    seq = Sequence(request_id, list(prompt), params, STOPS, arrival=0, device=torch.device("cpu"))
    seq.output_token_ids = list(output)
    return seq


def reference(logits_row, seq):
    """sample_next on this row alone, with a fresh generator for the request's seed."""
    params = seq.params
    return sample_next(logits_row[None], params, previous_ids=torch.tensor([seq.tokens]),
                       output_ids=torch.tensor([seq.output_token_ids], dtype=torch.long).reshape(1, -1),
                       stop_ids=STOPS, generator=params.make_generator())[0].item()


def params_strategy():
    sampled = st.builds(
        SamplingParams, max_tokens=st.just(8), seed=st.integers(0, 2**31),
        temperature=st.floats(0.3, 2.0),
        top_k=st.one_of(st.none(), st.integers(1, V + 5)),
        top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
        min_p=st.one_of(st.none(), st.floats(0.0, 0.5)),
        repetition_penalty=st.one_of(st.none(), st.floats(0.5, 2.0)),
        presence_penalty=st.floats(-2.0, 2.0), frequency_penalty=st.floats(-2.0, 2.0),
        logit_bias=st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=3),
        min_tokens=st.integers(0, 3),
    )
    greedy = st.builds(SamplingParams, max_tokens=st.just(8),
                       repetition_penalty=st.one_of(st.none(), st.floats(0.5, 2.0)),
                       frequency_penalty=st.floats(-2.0, 2.0), min_tokens=st.integers(0, 3),
                       logit_bias=st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=3))
    return st.one_of(sampled, greedy, st.just(SamplingParams()))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), rows=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_batched_sampler_equals_one_row_at_a_time(data, rows, seed):
    """Random mixes of greedy and seeded sampled rows, every parameter on or off, three steps in a row
    (the device-side counts then hold tokens the sampler itself added), each step the same batch (the
    sampler reuses its plan) or a random part of it in a random order (a new plan): every id equals
    sample_next on that row alone with the same seed."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(rows):
        prompt = data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=8))
        output = data.draw(st.lists(st.integers(0, V - 1), max_size=4))
        seqs.append(sequence(data.draw(params_strategy()), prompt, output, request_id=str(i)))
    sampler = Sampler(V, torch.device("cpu"))
    batch = seqs
    for _ in range(3):
        if data.draw(st.booleans()):  # else the same batch as the last step
            order = data.draw(st.permutations(range(rows)))
            batch = [seqs[i] for i in order[:data.draw(st.integers(1, rows))]]
        logits = torch.randn(len(batch), V, generator=gen) * 3
        want = [reference(logits[i], seq) for i, seq in enumerate(batch)]
        for seq in batch:  # the batch's generators restart from the seed, as the reference's did
            seq.generator = seq.params.make_generator()
        got = sampler.sample(logits, batch).ids.tolist()
        assert got == want
        for seq, token in zip(batch, got, strict=True):
            seq.output_token_ids.append(token)


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.5, seed=1)] * 3
    seqs = [sequence(p, [1, 2], request_id=str(i)) for i, p in enumerate(params)]
    ids = Sampler(V, torch.device("cpu")).sample(logits, seqs).ids
    assert ids[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def test_a_row_whose_temperature_is_below_sampling_eps_is_a_greedy_row():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(2)) * 4
    tiny = [0.0, 5e-324, 1e-40, 1e-38, 1e-6, SAMPLING_EPS / 2]
    seqs = [sequence(SamplingParams(temperature=t, top_k=5, seed=i), [1, 2], request_id=str(i))
            for i, t in enumerate(tiny)]
    sampler = Sampler(V, torch.device("cpu"))
    assert sampler.plan(seqs).sampled is None  # no row draws
    assert sampler.sample(logits, seqs).ids.tolist() == logits.argmax(-1).tolist()
    seqs[0] = sequence(SamplingParams(temperature=1.0, seed=0), [1, 2], request_id="s")  # beside a sampled row
    assert Sampler(V, torch.device("cpu")).sample(logits, seqs).ids[1:].tolist() == logits[1:].argmax(-1).tolist()


@settings(max_examples=40, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e3))
def test_batched_sampler_equals_one_row_at_a_time_over_every_accepted_value(data, seed, scale):
    """The parameters at the ends of their accepted ranges: every id still equals sample_next's, and is a
    token the reference gives a finite logit."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [sequence(dataclasses.replace(data.draw(extreme_params_strategy(V)), seed=seed + i), [i, 7, 7], [i],
                     request_id=str(i)) for i in range(4)]
    logits = torch.randn(4, V, generator=gen) * scale
    want = [reference(logits[i], seq) for i, seq in enumerate(seqs)]
    for seq in seqs:
        seq.generator = seq.params.make_generator()
    assert Sampler(V, torch.device("cpu")).sample(logits, seqs).ids.tolist() == want


def test_a_seeded_row_draws_the_same_alone_or_in_any_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, V, generator=gen)
    params = SamplingParams(temperature=1.5, top_k=30, repetition_penalty=1.3, seed=42)
    alone_ids = Sampler(V, torch.device("cpu")).sample(logits[2:3], [sequence(params, [4, 4, 9])]).ids
    others = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.7, seed=5)]
    for order in ([0, 1, 2], [2, 0, 1]):  # the seeded row at a different place, beside unseeded rows
        batch = [sequence(others[i], [1]) for i in order]
        batch.insert(1, sequence(params, [4, 4, 9]))
        rows = torch.cat([logits[:1], logits[2:3], logits[3:5]])
        assert Sampler(V, torch.device("cpu")).sample(rows, batch).ids[1] == alone_ids[0]


def test_penalties_change_logits_exactly_as_defined():
    """logit_bias, then repetition over prompt + output (vLLM/HF), then OpenAI's frequency and presence
    over the generated tokens only; computed by hand in float64."""
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1)) * 4
    prompt, output = [1, 2, 2, 7], [2, 9, 9, 9, 11]
    params = SamplingParams(repetition_penalty=1.7, presence_penalty=0.6, frequency_penalty=-0.3,
                            logit_bias={9: 2.5, 30: -100})
    seqs = [sequence(params, prompt, output), sequence(SamplingParams(), prompt, output)]
    sampler = Sampler(V, torch.device("cpu"))
    plan = BatchPlan.of(seqs, sampler.counts, V, torch.device("cpu"))
    got = penalise(logits, seqs, plan.penalties, sampler.counts)
    want = logits[0].double().clone()
    want[9] += 2.5
    want[30] -= 100
    for token in set(prompt + output):
        want[token] = want[token] / 1.7 if want[token] > 0 else want[token] * 1.7
    for token in set(output):
        want[token] -= 0.6 + (-0.3) * output.count(token)
    torch.testing.assert_close(got[0].double(), want, rtol=1e-6, atol=1e-5)
    assert torch.equal(got[1], logits[1])  # a row without adjustments is left exactly as it was


def test_min_tokens_bans_the_stop_ids_until_enough_tokens():
    logits = torch.zeros(1, V)
    logits[0, 3] = 10.0  # a stop id, the greedy choice
    for done, expected in ((0, 0), (1, 0), (2, 3)):
        seq = sequence(SamplingParams(min_tokens=2), [1], output=[8] * done)
        assert Sampler(V, torch.device("cpu")).sample(logits, [seq]).ids.item() == expected


def test_logit_bias_minus_100_bans_a_token_through_the_engine():
    """Greedy: the banned token is never the choice. Sampled at temperature 1: 300 draws never give it;
    the model's logits lie within +-15, so its probability is below e^(30 - 100) (false alarm < 1e-28)."""
    model = make_model("llama")
    prompt = make_prompts()[3]
    plain = alone(model, prompt, 6)
    banned = plain[0]
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=100))
    greedy = engine.generate([prompt], SamplingParams(max_tokens=6, logit_bias={banned: -100}), use_tqdm=False)[0]
    assert banned not in greedy and greedy[0] != plain[0]
    sampled = SamplingParams(max_tokens=30, temperature=1.0, logit_bias={banned: -100.0}, seed=0)
    outs = engine.generate([prompt] * 10, [dataclasses.replace(sampled, seed=i) for i in range(10)], use_tqdm=False)
    assert all(banned not in out for out in outs)


def test_engine_and_generate_agree_on_every_new_parameter():
    model64 = make_model("llama").double()  # float64: batched and alone logits agree far below sampling noise
    prompts = make_prompts()
    params = [SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=10 + i, presence_penalty=1.0,
                             frequency_penalty=0.5, repetition_penalty=1.2 if i % 2 else None,
                             logit_bias={1: 3.0, 2: -5.0}, min_tokens=4, stop_token_ids=[0, 7])
              for i in range(len(prompts))]
    params[0] = SamplingParams(max_tokens=8, frequency_penalty=1.5, min_tokens=2, stop_token_ids=[0])  # greedy
    engine = LLMEngine(model64, EngineConfig(block_size=4, num_blocks=100, max_num_batched_tokens=16), eos_token_id=9)
    got = engine.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, got, strict=True):
        want = alone(model64, prompt, p, eos_token_id=9)
        stop = next((i for i, t in enumerate(want) if t in (*p.stop_token_ids, 9)), len(want) - 1)
        assert out == want[:stop + 1]
        assert len(out) > p.min_tokens or len(out) == p.max_tokens


def test_token_count_rows_are_reused_after_requests_finish():
    model = make_model("gpt2")
    prompts = make_prompts() * 3  # more penalised requests than the table's first 8 rows, in waves
    params = SamplingParams(max_tokens=4, repetition_penalty=1.5, frequency_penalty=0.4)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=200, max_num_seqs=4))
    assert engine.generate(prompts, params, use_tqdm=False) == [alone(model, p, params) for p in prompts]
    assert engine.runner.sampler.counts.output.shape[0] == 8  # 4 running at a time: the rows came back


def full_logprobs(model, tokens):
    """log_softmax of one float64 forward over the whole sequence: (T, V)."""
    model64 = make_model("llama").double()
    model64.load_state_dict(model.state_dict())
    logits, _ = model64(torch.tensor([tokens]))
    return torch.log_softmax(logits[0], dim=-1)


def check_logprobs(model, prompt, out_ids, logprobs, prompt_logprobs, n, n_prompt):
    tokens = prompt + out_ids
    ref = full_logprobs(model, tokens)
    P = len(prompt)
    assert len(logprobs) == len(out_ids) and prompt_logprobs[0] is None and len(prompt_logprobs) == P
    scored = [(lp, P + i - 1) for i, lp in enumerate(logprobs)] + \
             [(lp, p - 1) for p, lp in enumerate(prompt_logprobs) if p > 0]
    for lp, position in scored:
        want_n = n if position >= P - 1 else n_prompt
        assert lp.token_id == tokens[position + 1]
        assert abs(lp.logprob - ref[position, lp.token_id].item()) < 1e-4
        top = ref[position].topk(want_n)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top], dtype=torch.float64), top.values,
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("budget, caching", [(512, False), (5, False), (7, True)])
def test_logprobs_equal_log_softmax_of_one_full_forward(budget, caching):
    """Sampled tokens with temperature and penalties: logprobs still of the RAW distribution. Prompt
    logprobs arrive once, complete, whether the prompt ran in chunks (budget 5 or 7 tokens a step) or
    shares cached blocks with an earlier request (requests asking them skip the prefix-cache lookup)."""
    model = make_model("llama")
    prompts = make_prompts()
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=200, max_num_batched_tokens=budget,
                                           enable_prefix_caching=caching))
    if caching:  # fill the cache with the shared prefix first
        engine.generate([prompts[1]], SamplingParams(max_tokens=2), use_tqdm=False)
    params = SamplingParams(max_tokens=5, temperature=0.7, repetition_penalty=1.3, logit_bias={4: 2.0}, seed=1,
                            logprobs=3, prompt_logprobs=2)
    ids = {engine.add_request(p, params): p for p in prompts[5:]}  # two of them start with prompts[1]'s prefix
    seen = {rid: dict(out=[], logprobs=[], prompt=[]) for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            record = seen[out.request_id]
            record["out"] += out.new_token_ids
            record["logprobs"] += out.logprobs
            if out.prompt_logprobs is not None:
                record["prompt"].append(out.prompt_logprobs)
    for rid, prompt in ids.items():
        record = seen[rid]
        assert len(record["prompt"]) == 1  # delivered once
        check_logprobs(model, prompt, record["out"], record["logprobs"], record["prompt"][0], 3, 2)


def test_logprobs_zero_gives_the_chosen_token_only_and_none_when_not_asked():
    model = make_model("gpt2")
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=50))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, logprobs=0))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    outs = [out for _ in range(2) for out in engine.step()]
    asked = [out for out in outs if out.request_id == "0"]
    assert all(isinstance(out.logprobs[0], TokenLogprob) and out.logprobs[0].top == () for out in asked)
    assert all(out.logprobs is None and out.prompt_logprobs is None for out in outs if out.request_id == "1")


def test_bad_new_parameters_are_refused_at_the_door():
    engine = LLMEngine(make_model("gpt2"), EngineConfig(block_size=4, num_blocks=50))
    with pytest.raises(InvalidRequest, match="logit_bias names token 50"):
        engine.add_request([1], SamplingParams(logit_bias={VOCAB: 1.0}))
    with pytest.raises(InvalidRequest, match="logprobs=51 exceeds"):
        engine.add_request([1], SamplingParams(prompt_logprobs=VOCAB + 1))
    assert not engine.has_unfinished_requests()
