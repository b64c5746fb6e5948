"""engine/batch_plan.py: the named per-row parameters against each request's own SamplingParams, the
filters the sampler runs on them against inference/sampling.py's one-row filtered_logits, and the plan
reused while the batch stays the same."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_transformer import SamplingParams
from mini_transformer.engine.batch_plan import BatchPlan, RowParams, RowValues, TokenCounts
from mini_transformer.engine.sampler import Sampler, filtered
from mini_transformer.engine.sequence import Sequence
from mini_transformer.inference.sampling import filtered_logits

V = 40
CPU = torch.device("cpu")


def sequence(params, prompt=(1, 2, 3), request_id="r"):
    return Sequence(request_id, list(prompt), params, (3,), arrival=0, device=CPU)


def sampled_params():
    return st.builds(SamplingParams, temperature=st.floats(0.3, 2.0),
                     top_k=st.one_of(st.none(), st.integers(1, V + 5)),
                     top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
                     min_p=st.one_of(st.none(), st.floats(0.0, 0.5)),
                     repetition_penalty=st.one_of(st.none(), st.floats(0.5, 2.0)),
                     presence_penalty=st.floats(-2.0, 2.0), frequency_penalty=st.floats(-2.0, 2.0))


def f32(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)[:, None]  # (M, 1), as RowParams holds them


def test_each_named_tensor_holds_its_rows_value_or_the_neutral_one():
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                             presence_penalty=0.5, frequency_penalty=-0.2),
              SamplingParams(),  # greedy, nothing set: every value leaves its step a no-op
              SamplingParams(temperature=1.2, top_k=V + 10, top_p=1.0)]
    row = RowParams.of(params, V, CPU)
    assert all(getattr(row, name).shape == (3, 1) for name in RowValues._fields)
    assert torch.equal(row.temperature, f32(0.7, 1.0, 1.2))
    assert torch.equal(row.top_k, f32(5, V, V))  # top-k past the vocabulary keeps every token
    assert torch.equal(row.top_p[:1], f32(0.9)) and (row.top_p[1:] > 1).all()  # off: above any mass
    assert torch.equal(row.min_p, f32(0.1, 0.0, 0.0))
    assert torch.equal(row.repetition_penalty, f32(1.3, 1.0, 1.0))
    assert torch.equal(row.presence_penalty, f32(0.5, 0.0, 0.0))
    assert torch.equal(row.frequency_penalty, f32(-0.2, 0.0, 0.0))
    taken = row.take(torch.tensor([2, 0]))
    assert all(torch.equal(getattr(taken, name), getattr(row, name)[[2, 0]]) for name in RowValues._fields)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), rows=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_filtered_rows_equal_the_one_row_reference(data, rows, seed):
    """Sampled and greedy rows mixed: the sampled rows' filtered logits, with the plan's named tensors and
    named switches, drop the same tokens as filtered_logits on each row alone and keep the same values."""
    params = [data.draw(st.one_of(sampled_params(), st.just(SamplingParams()))) for _ in range(rows)]
    seqs = [sequence(p, request_id=str(i)) for i, p in enumerate(params)]
    plan = BatchPlan.of(seqs, TokenCounts(V, CPU), V, CPU)
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    if not sampled:
        assert plan.sampled is None
        return
    assert plan.sampled.rows == sampled
    assert plan.sampled.any_top_k == any(params[r].top_k is not None and params[r].top_k < V for r in sampled)
    assert plan.sampled.any_top_p == any(params[r].top_p not in (None, 1.0) for r in sampled)
    assert plan.sampled.any_min_p == any(bool(params[r].min_p) for r in sampled)
    logits = torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3
    got = filtered(logits[sampled], plan.sampled)
    for i, row in enumerate(sampled):
        want = filtered_logits(logits[row:row + 1], params[row])[0]
        assert torch.equal(got[i].isfinite(), want.isfinite())
        torch.testing.assert_close(got[i][want.isfinite()], want[want.isfinite()])


def test_the_plan_has_no_penalties_part_without_a_bias_min_tokens_or_penalty():
    counts = TokenCounts(V, CPU)
    plain = [sequence(SamplingParams()), sequence(SamplingParams(temperature=0.8, top_p=0.9))]
    assert BatchPlan.of(plain, counts, V, CPU).penalties is None
    for params, repetition, presence_frequency in ((SamplingParams(logit_bias={1: 2.0}), False, False),
                                                   (SamplingParams(min_tokens=2), False, False),
                                                   (SamplingParams(repetition_penalty=1.2), True, False),
                                                   (SamplingParams(frequency_penalty=0.3), False, True)):
        penalties = BatchPlan.of([*plain, sequence(params)], counts, V, CPU).penalties
        assert penalties is not None
        assert (penalties.any_repetition, penalties.any_presence_frequency) == (repetition, presence_frequency)
        assert penalties.count_slots.tolist()[:2] == [0, 0]  # unpenalised rows read the zero row


@pytest.mark.parametrize("greedy_too", [False, True])
def test_the_plan_is_built_once_while_the_batch_is_the_same(greedy_too):
    params = [SamplingParams(temperature=0.9, seed=i, repetition_penalty=1.1) for i in range(3)]
    seqs = [sequence(p, request_id=str(i)) for i, p in enumerate(params)]
    if greedy_too:
        seqs.append(sequence(SamplingParams(), request_id="g"))
    sampler = Sampler(V, CPU)
    plan = sampler.plan(seqs)
    assert sampler.plan(list(seqs)) is plan  # the same sequences in the same order: reused
    assert sampler.plan(seqs[::-1]) is not plan  # another order: rows move, so a new plan
    assert (plan.sampled.index is None) != greedy_too  # every row draws: no index to take them
