"""engine/logprobs.py: the logprob tensors against log_softmax in float64, and read_back's one host read
unpacked onto the right sequences and positions (the engine's end-to-end logprobs are checked against a
full forward in test_engine_sampler.py)."""

import torch

from mini_transformer import SamplingParams
from mini_transformer.engine.logprobs import LogprobRows, LogprobsTensors, PromptLogprobs, Sampled, read_back
from mini_transformer.engine.sequence import Sequence, TokenLogprob

V = 30
CPU = torch.device("cpu")


def sequence(params, prompt, request_id="r"):
    return Sequence(request_id, list(prompt), params, (3,), arrival=0, device=CPU)


def reference(logits_row: torch.Tensor, token: int, n: int) -> TokenLogprob:
    logp = torch.log_softmax(logits_row.double(), dim=-1)
    top = logp.topk(n)
    return TokenLogprob(token, logp[token].item(), tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)))


def assert_close(got: TokenLogprob, want: TokenLogprob):
    assert got.token_id == want.token_id and [t for t, _ in got.top] == [t for t, _ in want.top]
    assert abs(got.logprob - want.logprob) < 1e-5
    assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(got.top, want.top, strict=True))


def test_logprobs_tensors_are_log_softmax_of_the_raw_logits():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 4
    chosen = torch.tensor([0, 5, 29, 7])
    out = LogprobsTensors.of(logits, chosen, 3)
    want = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(out.chosen.double(), want[torch.arange(4), chosen])
    assert out.top_ids.tolist() == want.topk(3).indices.tolist()
    none = LogprobsTensors.of(logits, chosen, 0)
    assert none.top_values is None and none.top_ids is None and len(none.parts()) == 1


def test_read_back_puts_each_logprob_on_its_sequence_and_position():
    """Three sampling rows (two ask logprobs, with different N) and one prompt asking prompt logprobs:
    every TokenLogprob that comes back equals the float64 reference of its row."""
    gen = torch.Generator().manual_seed(1)
    seqs = [sequence(SamplingParams(logprobs=2), [1, 2], "a"), sequence(SamplingParams(), [4], "b"),
            sequence(SamplingParams(logprobs=0), [5, 6], "c")]
    prompt_seq = sequence(SamplingParams(prompt_logprobs=1), [7, 8, 9], "p")
    logits = torch.randn(3, V, generator=gen)
    ids = torch.tensor([11, 12, 13])
    rows = LogprobRows.of(seqs, CPU)
    assert rows.rows == [0, 2] and rows.n == 2
    out = Sampled(ids, rows, LogprobsTensors.of(logits[rows.index], ids[rows.index], rows.n))
    prompt = PromptLogprobs.of([(prompt_seq, 3)])  # a whole prompt in one chunk: rows 0, 1 score tokens 1, 2
    assert prompt.rows == [0, 1] and prompt.targets == [8, 9]
    prompt_logits = torch.randn(2, V, generator=gen)
    prompt.compute(prompt_logits)
    assert read_back(out, seqs, prompt) == [11, 12, 13]
    assert_close(seqs[0].output_logprobs[0], reference(logits[0], 11, 2))
    assert seqs[1].output_logprobs == []
    assert_close(seqs[2].output_logprobs[0], reference(logits[2], 13, 0))
    assert prompt_seq.prompt_logprobs[0] is None
    for position in (1, 2):
        assert_close(prompt_seq.prompt_logprobs[position],
                     reference(prompt_logits[position - 1], prompt_seq.prompt_token_ids[position], 1))


def test_read_back_without_logprobs_is_the_ids_alone():
    seqs = [sequence(SamplingParams(), [1], str(i)) for i in range(3)]
    empty = PromptLogprobs.of([])
    assert read_back(Sampled(torch.tensor([4, 5, 6])), seqs, empty) == [4, 5, 6]
    assert read_back(None, [], empty) == []
