"""The engine's batched sampler: ONE pass over the (M, V) logits of every sequence that picks a token this
step, greedy and sampled rows together, each row with its own parameters.

inference/sampling.py's `sample_next` is the reference: one request, scalar parameters. Here the same
chain runs on the whole batch with per-row parameter tensors (`RowParams`, in the batch's `BatchPlan`,
engine/batch_plan.py): a row that does not use a step gets a value that leaves it exactly unchanged
(temperature 1, top-k V, top-p off, min-p 0, penalties 1 / 0):

    logit_bias -> min_tokens -> repetition -> frequency/presence      every row (greedy ones too)
    grammar mask (-inf where the grammar forbids)                    constrained rows (engine/structured.py)
    argmax                                                           greedy rows
    temperature -> top-k -> top-p -> min-p -> draw                   sampled rows

The penalties read token counts that live on the device (`TokenCounts`), updated there with the sampled
ids; nothing is rebuilt from the token lists. A seeded request draws its noise from its own generator, row
by row, so it gets the same tokens alone, in any batch, and from generate(). The logprobs and the step's
one device -> host read live in engine/logprobs.py.
"""

from __future__ import annotations

import torch

from ..inference.sampling import apply_presence_frequency, repetition_penalised, sorted_descending, top_p_cut
from ..model.fused_ops import argmax_rows
from .batch_plan import BatchPlan, Penalties, SampledRows, TokenCounts
from .logprobs import LogprobsTensors, Sampled, to_device
from .sequence import Sequence
from .structured import GrammarMasks


def penalise(x: torch.Tensor, seqs: list[Sequence], penalties: Penalties, counts: TokenCounts) -> torch.Tensor:
    """logit_bias, min_tokens, repetition, frequency and presence on (M, V) float logits, per row."""
    device = x.device
    if penalties.bias is not None:
        rows, ids, bias = penalties.bias
        x = x.index_put((rows, ids), bias, accumulate=True)  # x is float32 (sample's logits.float())
    banned_rows, banned_ids = [], []
    for row in penalties.min_tokens_rows:
        seq = seqs[row]
        if len(seq.output_token_ids) < seq.params.min_tokens:
            banned_rows += [row] * len(seq.stop_token_ids)
            banned_ids += seq.stop_token_ids
    if banned_rows:
        index = (to_device(banned_rows, torch.long, device), to_device(banned_ids, torch.long, device))
        x = x.index_put(index, torch.full((), float("-inf"), device=device))
    if penalties.any_penalty:
        output = counts.output[penalties.count_slots]  # (M, V)
        params = penalties.params
        if penalties.any_repetition:
            seen = counts.in_prompt[penalties.count_slots] | (output > 0)  # (M, V)
            x = repetition_penalised(x, seen, params.repetition_penalty)
        if penalties.any_presence_frequency:
            x = apply_presence_frequency(x, output, params.presence_penalty, params.frequency_penalty)
    return x


def filtered(x: torch.Tensor, sampled: SampledRows) -> torch.Tensor:
    """(S, V) penalised logits of sampled rows -> temperature, top-k, top-p, min-p (sampling.py's order),
    with each row's own values; a filter no row uses is skipped."""
    params = sampled.params
    x = x / params.temperature  # (S, V)
    if sampled.any_top_k or sampled.any_top_p:
        sorted_x = sorted_descending(x)  # (S, V), one sort of the values serves both cuts
        if sampled.any_top_k:
            kth = sorted_x.gather(1, params.top_k.long() - 1)  # (S, 1): the k-th largest logit
            x = x.masked_fill(x < kth, float("-inf"))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if sampled.any_top_p:
            x = x.masked_fill(x < top_p_cut(sorted_x, params.top_p), float("-inf"))
    if sampled.any_min_p:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return x


def draw(probs: torch.Tensor, seeded: list[tuple[int, torch.Generator]], unseeded: bool = True) -> torch.Tensor:
    """(S, V) probabilities -> (S,) ids by sampling.draw_from_probs's exponential race; a seeded row
    (row, its generator) draws its noise from its generator (the same draws as sample_next on that row
    alone), the others (if `unseeded`) share one draw from torch's global generator."""
    race = torch.empty_like(probs, dtype=torch.float32)
    if unseeded:
        race.uniform_()
    for row, generator in seeded:
        race[row].uniform_(generator=generator)
    return (probs / race.log_().neg_()).argmax(dim=-1)  # -log(U) ~ Exp(1), as sampling.exponential_noise


class Sampler:
    """The engine's sampler: the token counts and grammar masks it keeps across steps, and the last plan."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.counts = TokenCounts(vocab_size, device)
        self.grammar = GrammarMasks(vocab_size, device)  # structured output; idle while no row is constrained
        self._plan: BatchPlan | None = None

    def plan(self, seqs: list[Sequence]) -> BatchPlan:
        """The batch's plan: the last step's when the batch is the same sequences in the same order."""
        if self._plan is None or self._plan.seqs != tuple(seqs):  # tuple equality: identity first, so cheap
            self._plan = BatchPlan.of(seqs, self.counts, self.vocab_size, self.device)
        return self._plan

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        """(M, V) logits of the sequences that pick a token this step -> their ids (and the logprobs asked
        for), on the device."""
        plan = self.plan(seqs)
        raw = logits.float()
        x = raw
        if plan.penalties is not None:
            x = penalise(raw, seqs, plan.penalties, self.counts)
        if plan.any_constrained:  # after the penalties, before argmax and the filters
            x = self.grammar.apply(raw.clone() if x is raw else x, seqs)  # raw stays raw for the logprobs
        sampled = plan.sampled
        ids = argmax_rows(x) if sampled is None or sampled.index is not None else None  # (M,); greedy rows keep it
        if sampled is not None:
            index = sampled.index  # None: every row draws
            probs = torch.softmax(filtered(x if index is None else x[index], sampled), dim=-1)  # (S, V)
            seeded = [(i, seqs[row].generator) for i, row in sampled.seeded]  # each step: generators can be swapped
            drawn = draw(probs, seeded, unseeded=len(seeded) < len(sampled.rows))
            ids = drawn if index is None else ids.index_copy(0, index, drawn)
        if plan.penalties is not None and plan.penalties.any_penalty:  # count where the next step reads them
            self.counts.output.index_put_((plan.penalties.penalised_slots, ids[plan.penalties.penalised_index]),
                                          torch.ones((), dtype=torch.int32, device=self.device), accumulate=True)
        out = Sampled(ids, plan.logprob_rows)
        if plan.logprob_rows is not None:
            index = plan.logprob_rows.index
            out.logprobs = LogprobsTensors.of(raw[index], ids[index], plan.logprob_rows.n)
        return out
