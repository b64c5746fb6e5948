"""sampling.py on hand-made distributions (the boundary token of each filter), against Hugging Face's
logits processors on random logits, seeded reproducibility, and the errors for bad values."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_transformer.inference.sampling import (
    MAX_SAMPLING_FACTOR,
    SAMPLING_EPS,
    SamplingParams,
    apply_repetition_penalty,
    draw_from_probs,
    filtered_logits,
    min_p_filter,
    penalised_logits,
    sample_next,
    top_k_filter,
    top_p_filter,
)

INF = float("inf")


def logits_of(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()  # softmax(log p) == p


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row > -INF).flatten().tolist() for row in logits]


def test_greedy_picks_the_argmax_of_each_row():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 5.0, 1.0]])
    assert sample_next(logits, SamplingParams(temperature=0.0)).tolist() == [1, 0]  # first index on a tie
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


def test_temperature_sharpens_or_flattens_the_sampled_distribution():
    """Low temperature concentrates the draws on the top token, high temperature spreads them.
    4000 draws per case; the bounds sit more than 6 standard deviations from the expected shares."""
    logits = torch.tensor([[1.0, 2.0, 4.0]]).expand(4000, 3)
    gen = torch.Generator().manual_seed(0)

    def top_share(t):
        return (sample_next(logits, SamplingParams(temperature=t), generator=gen) == 2).double().mean()

    assert top_share(0.1) > 0.99  # p(top) = 0.99999995 at T=0.1
    assert 0.80 < top_share(1.0) < 0.88  # p(top) = 0.844
    assert top_share(10.0) < 0.45  # p(top) = 0.402


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [4.0, 3.0, 2.0, 1.0]])
    assert kept(top_k_filter(logits, 2)) == [[1, 2], [0, 1]]
    assert kept(top_k_filter(logits, 1)) == [[1], [0]]
    assert torch.equal(top_k_filter(logits, 4), logits) and torch.equal(top_k_filter(logits, 99), logits)


def test_top_k_keeps_tokens_tied_with_the_kth():
    assert kept(top_k_filter(torch.tensor([[3.0, 2.0, 2.0, 1.0]]), 2)) == [[0, 1, 2]]


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.4, [0]),  # the top token alone already crosses 0.4
        (0.5, [0]),  # exactly reaches 0.5: nothing more is needed
        (0.6, [0, 1]),  # 0.5 < 0.6: the token that crosses (0.3) is kept
        (0.79, [0, 1]),
        (0.81, [0, 1, 2]),  # 0.8 < 0.81: the 0.15 token crosses and is kept
        (0.96, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_token_that_crosses_p(top_p, expected):
    logits = logits_of([[0.5, 0.3, 0.15, 0.05]])
    assert kept(top_p_filter(logits, top_p)) == [expected]


def test_a_top_p_that_rounds_to_zero_in_float32_keeps_the_top_token():
    """5e-324 > 0 is a valid top_p, but 0 as a float32 (schemathesis sent it to the server: a 500)."""
    logits = logits_of([[0.5, 0.3, 0.15, 0.05]])
    assert kept(top_p_filter(logits, 5e-324)) == [[0]]


def test_top_p_works_per_row_in_any_vocabulary_order():
    logits = logits_of([[0.05, 0.15, 0.3, 0.5], [0.1, 0.7, 0.1, 0.1]])
    assert kept(top_p_filter(logits, 0.6)) == [[2, 3], [1]]


@pytest.mark.parametrize(
    "min_p, expected",
    [(0.0, [0, 1, 2, 3]), (0.1, [0, 1, 2]), (0.5, [0, 1]), (0.51, [0]), (1.0, [0])],
)
def test_min_p_drops_tokens_below_a_fraction_of_the_top(min_p, expected):
    # threshold = min_p * 0.6: 0.06 keeps the 0.08 token, 0.3 keeps the 0.3 token (boundary kept)
    logits = logits_of([[0.6, 0.3, 0.08, 0.02]])
    assert kept(min_p_filter(logits, min_p)) == [expected]


def test_repetition_penalty_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1, 0]]), 2.0)
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 0.5, 3.0]]))  # positive / 2, negative * 2
    assert torch.equal(apply_repetition_penalty(logits, torch.tensor([[0, 1]]), 1.0), logits)


def test_repetition_penalty_ignores_padding():
    logits = torch.tensor([[2.0, 2.0, 2.0]])
    previous = torch.tensor([[0, 0, 2]])
    mask = torch.tensor([[False, False, True]])  # token 0 only appears as padding
    out = apply_repetition_penalty(logits, previous, 4.0, previous_mask=mask)
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.0, 0.5]]))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), top_k=st.integers(1, 12), top_p=st.floats(0.05, 1.0),
       min_p=st.floats(0.0, 1.0), penalty=st.floats(0.5, 3.0), temperature=st.floats(0.2, 3.0))
def test_filters_match_hugging_face_processors(seed, top_k, top_p, min_p, penalty, temperature):
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 10, generator=gen, dtype=torch.float64) * 3
    previous = torch.randint(0, 10, (3, 4), generator=gen)
    torch.testing.assert_close(logits / temperature, TemperatureLogitsWarper(temperature)(None, logits))
    torch.testing.assert_close(apply_repetition_penalty(logits, previous, penalty),
                               RepetitionPenaltyLogitsProcessor(penalty)(previous, logits))
    assert kept(top_k_filter(logits, top_k)) == kept(TopKLogitsWarper(top_k)(None, logits))
    assert kept(min_p_filter(logits, min_p)) == kept(MinPLogitsWarper(min_p)(None, logits))
    # top-p: compare away from ties between the cumulative mass and p (float rounding decides those)
    probs = torch.softmax(logits, -1).sort(dim=-1, descending=True).values.cumsum(-1)
    if (probs - top_p).abs().min() > 1e-6:
        assert kept(top_p_filter(logits, top_p)) == kept(TopPLogitsWarper(top_p)(None, logits))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), top_k=st.one_of(st.none(), st.integers(1, 12)),
       top_p=st.one_of(st.none(), st.floats(0.05, 1.0)), min_p=st.one_of(st.none(), st.floats(0.0, 1.0)),
       temperature=st.floats(0.2, 3.0))
def test_filtered_logits_is_hugging_faces_warper_chain(seed, top_k, top_p, min_p, temperature):
    """filtered_logits = HF's temperature -> top-k -> top-p -> min-p warpers, applied in that order."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
    want = TemperatureLogitsWarper(temperature)(None, logits)
    # top-p: stay away from ties between the cumulative mass and p (float rounding decides those)
    if top_p is not None:
        after_top_k = want if top_k is None else TopKLogitsWarper(top_k)(None, want)
        mass = torch.softmax(after_top_k, -1).sort(dim=-1, descending=True).values.cumsum(-1)
        if (mass - top_p).abs().min() <= 1e-6:
            return
    for warper, value in ((TopKLogitsWarper, top_k), (TopPLogitsWarper, top_p), (MinPLogitsWarper, min_p)):
        if value is not None:
            want = warper(value)(None, want)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = filtered_logits(logits, params)
    assert kept(got) == kept(want)
    keep = want > -INF
    torch.testing.assert_close(got[keep].double(), want[keep], rtol=1e-6, atol=1e-6)


def test_draw_from_probs_needs_no_normalised_weights():
    """Weights 4 : 3 : 2 : 1 : 0, not summing to one: drawn in those proportions, the zero never; the same
    seed gives the same draws whatever the scale of the weights."""
    weights = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(20000, 5)
    ids = draw_from_probs(weights * 7, torch.Generator().manual_seed(0))
    assert torch.equal(ids, draw_from_probs(weights, torch.Generator().manual_seed(0)))
    shares = torch.bincount(ids, minlength=5).double() / len(ids)
    assert shares[4] == 0
    # 20000 draws: each share's standard deviation is at most 0.0035, so 0.02 is 5.7 of them (false alarm < 1e-7)
    torch.testing.assert_close(shares[:4], torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64),
                               atol=0.02, rtol=0)


def test_filters_compose_and_never_produce_nan():
    logits = torch.tensor([[1e4, -1e4, 0.0, 50.0], [-INF, 0.0, -INF, -INF]])
    out = min_p_filter(top_p_filter(top_k_filter(logits / 0.01, 3), 0.2), 0.5)
    probs = torch.softmax(out, -1)
    assert not probs.isnan().any()
    assert kept(out) == [[0], [1]]
    params = SamplingParams(temperature=5.0, top_k=2, top_p=0.5, min_p=0.1)
    ids = sample_next(logits, params, generator=torch.Generator())
    assert ids.tolist() == [0, 1]


def test_top_k_one_equals_greedy_at_any_temperature():
    logits = torch.randn(8, 30)
    for temperature in (0.5, 1.0, 10.0):
        params = SamplingParams(temperature=temperature, top_k=1)
        ids = sample_next(logits, params, generator=torch.Generator().manual_seed(1))
        assert torch.equal(ids, logits.argmax(-1))


def test_sampling_follows_the_filtered_distribution():
    """Dropped tokens are never drawn; kept ones with their renormalised probability."""
    probs = [0.4, 0.3, 0.2, 0.1]
    logits = logits_of([probs] * 20000)
    ids = sample_next(logits, SamplingParams(temperature=1.0, top_p=0.65), generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(ids, minlength=4).double() / len(ids)
    assert counts[2] == 0 and counts[3] == 0  # 0.4 + 0.3 crosses 0.65; the rest are dropped
    # 20000 draws: the standard deviation of each share is 0.0035, so 0.02 is 5.7 of them (false alarm < 1e-7)
    torch.testing.assert_close(counts[:2], torch.tensor([4 / 7, 3 / 7], dtype=torch.float64), atol=0.02, rtol=0)


def test_same_seed_same_sample_and_other_seed_other_sample():
    logits = torch.randn(64, 40)

    def draw(seed):
        params = SamplingParams(temperature=1.0, top_p=0.95)
        return sample_next(logits, params, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    assert sample_next(logits, SamplingParams()).tolist() == [0]
    previous = torch.tensor([[0]])
    assert sample_next(logits, SamplingParams(repetition_penalty=2.0), previous_ids=previous).tolist() == [1]


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    """OpenAI: logit -= presence * (count > 0) + frequency * count, count over the output; the prompt's
    tokens are not penalised (unlike repetition_penalty)."""
    logits = torch.tensor([[1.0, 2.0, 3.0, -1.0, 0.5]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = penalised_logits(logits, params, previous_ids=torch.tensor([[4, 4, 1, 1, 1, 3]]),
                           output_ids=torch.tensor([[1, 1, 1, 3]]))
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0 - 0.5 - 0.75, 3.0, -1.0 - 0.5 - 0.25, 0.5]]))


def test_logit_bias_and_min_tokens():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    biased = penalised_logits(logits, SamplingParams(logit_bias={0: 5.0, 2: -100}))
    torch.testing.assert_close(biased, torch.tensor([[6.0, 2.0, -97.0]]))
    params = SamplingParams(min_tokens=2, max_tokens=4)
    for generated, expected in ((0, 1), (1, 1), (2, 2)):  # the stop id 2 is banned until 2 tokens are out
        output = torch.zeros(1, generated, dtype=torch.long)
        assert sample_next(logits, params, output_ids=output, stop_ids=(2,)).item() == expected


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(presence_penalty=2.5), ValueError, r"presence_penalty=2.5 must be in \[-2, 2\]"),
        (dict(frequency_penalty=float("nan")), ValueError, "frequency_penalty=nan"),
        (dict(frequency_penalty=None), TypeError, "frequency_penalty=None must be a number"),
        (dict(logit_bias={1: 101.0}), ValueError, r"logit_bias\[1\]=101.0 must be in \[-100, 100\]"),
        (dict(logit_bias={-1: 1.0}), ValueError, "logit_bias token id=-1"),
        (dict(logit_bias={"5": 1.0}), TypeError, "logit_bias token id='5' must be an int"),
        (dict(logit_bias=[(1, 1.0), (1, 2.0)]), ValueError, "names a token id twice"),
        (dict(logit_bias="x"), TypeError, "logit_bias='x'"),
        (dict(min_tokens=5, max_tokens=4), ValueError, "min_tokens=5 must be <= max_tokens=4"),
        (dict(min_tokens=-1), ValueError, "min_tokens=-1 must be a non-negative integer"),
        (dict(logprobs=-1), ValueError, "logprobs=-1"),
        (dict(prompt_logprobs=1.0), TypeError, "prompt_logprobs=1.0 must be an int"),
    ],
)
def test_bad_new_parameters_raise(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_logit_bias_is_kept_as_sorted_pairs_so_params_stay_hashable():
    params = SamplingParams(logit_bias={7: 1, 2: -3.5})
    assert params.logit_bias == ((2, -3.5), (7, 1.0))
    assert hash(params) == hash(SamplingParams(logit_bias={2: -3.5, 7: 1}))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(temperature=-0.1), ValueError, "temperature=-0.1 must be a finite number >= 0"),
        (dict(temperature=math.nan), ValueError, "temperature=nan"),
        (dict(temperature=math.inf), ValueError, "temperature=inf"),
        (dict(temperature="hot"), TypeError, "temperature='hot' must be a number"),
        (dict(top_k=0), ValueError, "top_k=0 must be a positive integer"),
        (dict(top_k=2.5), TypeError, "top_k=2.5 must be an int"),
        (dict(top_p=0.0), ValueError, r"top_p=0.0 must be in \(0, 1\]"),
        (dict(top_p=1.5), ValueError, r"top_p=1.5 must be in \(0, 1\]"),
        (dict(top_p=-0.2), ValueError, "top_p=-0.2"),
        (dict(min_p=-0.1), ValueError, r"min_p=-0.1 must be in \[0, 1\]"),
        (dict(min_p=1.1), ValueError, "min_p=1.1"),
        (dict(repetition_penalty=0.0), ValueError, "repetition_penalty=0.0 must be a finite number > 0"),
        (dict(repetition_penalty=-1.0), ValueError, "repetition_penalty=-1.0"),
        (dict(top_k=True), TypeError, "top_k=True"),
    ],
)
def test_bad_values_raise(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(max_tokens=0), ValueError, "max_tokens=0 must be a positive integer"),
        (dict(max_tokens=2.0), TypeError, "max_tokens=2.0 must be an int"),
        (dict(stop_token_ids=[1, -2]), ValueError, r"stop_token_ids contains -2, expected token ids >= 0"),
        (dict(stop_token_ids=5), TypeError, "stop_token_ids=5 must be a list"),  # the wrong kind: TypeError
    ],
)
def test_bad_lengths_and_stops_raise(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)
    with pytest.raises(TypeError, match="seed='x' must be an int"):
        SamplingParams(seed="x")
    with pytest.raises(TypeError, match="ignore_eos=1 must be a bool"):
        SamplingParams(ignore_eos=1)


def test_sampling_params_are_frozen_and_name_every_stop():
    params = SamplingParams(stop_token_ids=[3, 4])
    assert params.stop_token_ids == (3, 4)  # a list comes in, a tuple is kept (hashable, immutable)
    assert params.stops(eos_token_id=0) == (3, 4, 0) and params.stops(None) == (3, 4)
    assert SamplingParams(stop_token_ids=[3], ignore_eos=True).stops(eos_token_id=0) == (3,)
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # frozen: checked once, never changed behind the check's back
    assert params.make_generator() is None
    a, b = SamplingParams(seed=5).make_generator(), SamplingParams(seed=5).make_generator()
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e-38, 1e-37, 1e-6, SAMPLING_EPS / 2])
def test_a_temperature_below_sampling_eps_is_greedy(temperature):
    """Dividing by such a temperature would overflow to inf and the draw would return token 0."""
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 5
    params = SamplingParams(temperature=temperature, top_k=10, seed=0)
    assert params.greedy
    assert sample_next(logits, params, generator=params.make_generator()).tolist() == logits.argmax(-1).tolist()
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy


def extreme_params_strategy(vocab: int):
    """Every sampling parameter over its whole accepted range, the ends included."""
    factor = st.floats(1 / MAX_SAMPLING_FACTOR, MAX_SAMPLING_FACTOR)
    return st.builds(
        SamplingParams, max_tokens=st.just(8),
        temperature=st.one_of(st.floats(0.0, MAX_SAMPLING_FACTOR), st.floats(0.0, 1e-3),
                              st.sampled_from([0.0, 5e-324, 1e-40, SAMPLING_EPS, MAX_SAMPLING_FACTOR])),
        top_k=st.one_of(st.none(), st.integers(1, vocab + 2)),
        top_p=st.one_of(st.none(), st.floats(0.0, 1.0, exclude_min=True), st.just(5e-324)),
        min_p=st.one_of(st.none(), st.floats(0.0, 1.0)),
        repetition_penalty=st.one_of(st.none(), factor,
                                     st.sampled_from([1 / MAX_SAMPLING_FACTOR, MAX_SAMPLING_FACTOR])),
        presence_penalty=st.floats(-2.0, 2.0), frequency_penalty=st.floats(-2.0, 2.0),
        logit_bias=st.dictionaries(st.integers(0, vocab - 1), st.floats(-100, 100), max_size=vocab),
        min_tokens=st.integers(0, 3),
    )


@settings(max_examples=200, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e3))
def test_no_accepted_parameter_makes_the_logits_inf_or_nan(data, seed, scale):
    """Over every accepted value: the penalised logits stay finite (or -inf where banned), the sampled token
    has a finite logit and a probability > 0, and a greedy request takes the penalised argmax."""
    vocab = 12
    params = data.draw(extreme_params_strategy(vocab))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, vocab, generator=gen) * scale
    previous = torch.randint(0, vocab, (3, 6), generator=gen)
    output = previous[:, 3:]
    stops = (1, 2)  # banned while the output is shorter than min_tokens
    x = penalised_logits(logits, params, previous_ids=previous, output_ids=output, stop_ids=stops)
    assert not x.isnan().any() and not (x == INF).any() and x.isfinite().any(dim=-1).all()
    ids = sample_next(logits, params, previous_ids=previous, output_ids=output, stop_ids=stops, generator=gen)
    if params.greedy:
        assert ids.tolist() == x.argmax(-1).tolist()
        return
    f = filtered_logits(x, params)
    assert not f.isnan().any() and not (f == INF).any()
    assert f.gather(1, ids[:, None]).isfinite().all()
    assert (torch.softmax(f, -1).gather(1, ids[:, None]) > 0).all()


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**16), temperature=st.floats(SAMPLING_EPS, 1e-4))
def test_sampling_becomes_the_argmax_as_the_temperature_goes_to_zero(seed, temperature):
    """Just above SAMPLING_EPS, a top token ahead by 0.1 holds all the probability float32 can express."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 30, generator=gen)
    top2 = logits.topk(2, dim=-1)
    logits.scatter_(1, top2.indices[:, :1], top2.values[:, 1:] + 0.1)  # the gap: 0.1 at least
    ids = sample_next(logits, SamplingParams(temperature=temperature), generator=gen)
    assert ids.tolist() == logits.argmax(-1).tolist()
