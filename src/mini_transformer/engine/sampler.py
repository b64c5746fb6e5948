"""The engine's batched sampler: ONE pass over the (M, V) logits of every sequence that picks a token this
step, greedy and sampled rows together, each row with its own parameters.

inference/sampling.py's `sample_next` is the reference: one request, scalar parameters. Here the same
chain runs on the whole batch with per-row parameter tensors (a row that does not use a step gets a value
that leaves it exactly unchanged: temperature 1, top-k V, top-p off, min-p 0, penalties 1 / 0):

    logit_bias -> min_tokens -> repetition -> frequency/presence      every row (greedy ones too)
    grammar mask (-inf where the grammar forbids)                    constrained rows (engine/structured.py)
    argmax                                                           greedy rows
    temperature -> top-k -> top-p -> min-p -> draw                   sampled rows

The penalties read token counts that live on the device (`TokenCounts`), one row per penalised sequence,
updated there with the sampled ids; nothing is rebuilt from the token lists. A seeded request draws its
noise from its own generator, row by row, so it gets the same tokens alone, in any batch, and from
generate(). Log-probabilities come from the RAW logits (log_softmax before any bias, penalty or
temperature: vLLM's default). Everything the host needs -- the ids, and the logprobs when asked -- comes
back in one read (`read_back`), the step's only device -> host copy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..inference.sampling import (
    SamplingParams,
    apply_presence_frequency,
    repetition_penalised,
    sorted_descending,
    top_p_cut,
)
from .sequence import Sequence, TokenLogprob
from .structured import GrammarMasks

_TOP_P_OFF = 2.0  # above any cumulative mass: keeps every token (top_p 1.0 could drop a tail by rounding)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor; on CUDA through pinned memory, without waiting for the copy."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=4096)
def row_values(params: SamplingParams, vocab_size: int) -> tuple[float, ...]:
    """One request's numbers for the per-row tensors, neutral where it skips a step:
    (temperature, top_k, top_p, min_p, repetition, presence, frequency)."""
    return (1.0 if params.greedy else params.temperature,
            float(min(params.top_k or vocab_size, vocab_size)),  # float32 holds ids < 2**24 exactly
            _TOP_P_OFF if params.top_p in (None, 1.0) else params.top_p,
            params.min_p or 0.0,
            params.repetition_penalty or 1.0,
            params.presence_penalty,
            params.frequency_penalty)


class TokenCounts:
    """Token counts that live on the device, one row per penalised sequence; row 0 stays all zero, and
    every unpenalised row of a batch reads it. A sequence gets its row the first time it samples (its
    prompt and outputs so far are counted then, one copy from the host); after that each step adds the
    sampled ids on the device. A finished sequence's row is reused; a preempted one keeps its row (its
    tokens stay).

        output    (rows, V) int32: how often each token was generated (presence / frequency)
        in_prompt (rows, V) bool:  which tokens the prompt holds (with output > 0: the repetition penalty)
    """

    def __init__(self, vocab_size: int, device: torch.device, rows: int = 8):
        self.vocab_size, self.device = vocab_size, device
        self.output = torch.zeros(rows, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)
        self.row_of: dict[Sequence, int] = {}
        self.free = list(range(rows - 1, 0, -1))  # row 0 is the shared zero row

    def row(self, seq: Sequence) -> int:
        row = self.row_of.get(seq)
        return self._assign(seq) if row is None else row

    def _assign(self, seq: Sequence) -> int:
        if not self.free:  # take back the rows of finished sequences, else double the table
            done = [s for s in self.row_of if s.is_finished]
            self.free = [self.row_of.pop(s) for s in done]
        if not self.free:
            rows = self.output.shape[0]
            self.output = torch.cat([self.output, torch.zeros_like(self.output)])
            self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
            self.free = list(range(2 * rows - 1, rows - 1, -1))
        row = self.free.pop()
        self.row_of[seq] = row
        self.in_prompt[row] = False
        self.in_prompt[row, to_device(seq.prompt_token_ids, torch.long, self.device)] = True
        self.output[row] = 0
        if seq.output_token_ids:  # a sequence handed over from another engine has its first token already
            ids = to_device(seq.output_token_ids, torch.long, self.device)
            self.output[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return row


@dataclass
class Sampled:
    """One step's sampling, still on the device. ids (M,); for the rows asking logprobs (their indices
    in `logprob_rows`): the chosen token's logprob (L,) and the top-N (L, N) values and ids."""

    ids: torch.Tensor
    logprob_rows: list[int]
    chosen: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None


@dataclass
class BatchPlan:
    """What the sampler knows about a batch of sequences before seeing its logits, as host lists and small
    device tensors. Nothing in it changes while the batch stays the same (a request's parameters and its
    count row are fixed for its life), and in a decode phase the batch IS the same step after step: the
    sampler builds it once and reuses it (vLLM's persistent batch, in small). Only what moves per step --
    min_tokens (the output grows), the generators, the grammar's mask -- is read from the sequences each step.

        values (M, 7)  row_values of every row;  slots (M,) each row's TokenCounts row (0: none)
        sampled        rows that draw (the rest take the argmax), sampled_index on the device (None: all)
        penalised      rows with a penalty, with their count rows (count_index, count_rows) on the device
        use            filters some sampled row needs; repetition / presence_frequency: penalties some row uses
    """

    seqs: tuple[Sequence, ...]
    values: torch.Tensor
    slots: torch.Tensor
    sampled: list[int]
    sampled_index: torch.Tensor | None
    penalised: list[int]
    count_index: torch.Tensor
    count_rows: torch.Tensor
    use: set[str]
    repetition: bool
    presence_frequency: bool
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, ids, values of every logit_bias
    min_tokens: list[int]  # rows whose request has a min_tokens (banned stop ids while it is not reached)
    logprob_rows: list[int]
    seeded: list[tuple[int, int]]  # (place among the sampled rows, row) of the rows with their own generator
    constrained: bool  # does some row follow a grammar (engine/structured.py)?

    @classmethod
    def of(cls, seqs: list[Sequence], counts: TokenCounts, vocab_size: int, device: torch.device) -> BatchPlan:
        params = [seq.params for seq in seqs]
        sampled = [row for row, p in enumerate(params) if not p.greedy]
        penalised = [row for row, p in enumerate(params) if p.penalised]
        slots = [counts.row(seqs[row]) if row in penalised else 0 for row in range(len(seqs))]
        rows, ids, bias = [], [], []
        for row, p in enumerate(params):
            for token, value in p.logit_bias:
                rows.append(row), ids.append(token), bias.append(value)
        long = torch.long
        return cls(
            tuple(seqs), to_device([row_values(p, vocab_size) for p in params], torch.float32, device),
            to_device(slots, long, device), sampled,
            None if len(sampled) == len(seqs) else to_device(sampled, long, device),
            penalised, to_device(penalised, long, device), to_device([slots[r] for r in penalised], long, device),
            set().union(*(filters_used(params[row], vocab_size) for row in sampled)),
            any(p.repetition_penalty not in (None, 1.0) for p in params),
            any(p.presence_penalty or p.frequency_penalty for p in params),
            (to_device(rows, long, device), to_device(ids, long, device), to_device(bias, torch.float32, device))
            if rows else None,
            [row for row, p in enumerate(params) if p.min_tokens],
            [row for row, p in enumerate(params) if p.logprobs is not None],
            [(i, row) for i, row in enumerate(sampled) if seqs[row].generator is not None],
            any(seq.grammar is not None for seq in seqs))


def penalise(x: torch.Tensor, seqs: list[Sequence], plan: BatchPlan, counts: TokenCounts) -> torch.Tensor:
    """logit_bias, min_tokens, repetition, frequency and presence on (M, V) float logits, per row."""
    device = x.device
    if plan.bias is not None:
        rows, ids, bias = plan.bias
        x = x.index_put((rows, ids), bias, accumulate=True)  # x is float32 (sample's logits.float())
    banned_rows, banned_ids = [], []
    for row in plan.min_tokens:
        seq = seqs[row]
        if len(seq.output_token_ids) < seq.params.min_tokens:
            banned_rows += [row] * len(seq.stop_token_ids)
            banned_ids += seq.stop_token_ids
    if banned_rows:
        index = (to_device(banned_rows, torch.long, device), to_device(banned_ids, torch.long, device))
        x = x.index_put(index, torch.full((), float("-inf"), device=device))
    if plan.penalised:
        output = counts.output[plan.slots]  # (M, V)
        values = plan.values
        if plan.repetition:
            seen = counts.in_prompt[plan.slots] | (output > 0)
            x = repetition_penalised(x, seen, values[:, 4:5])
        if plan.presence_frequency:
            x = apply_presence_frequency(x, output, values[:, 5:6], values[:, 6:7])
    return x


def filtered(x: torch.Tensor, values: torch.Tensor, use: set[str]) -> torch.Tensor:
    """(S, V) penalised logits of sampled rows -> temperature, top-k, top-p, min-p (sampling.py's order),
    with each row's own values; `use` names the filters some row needs (the others are skipped)."""
    x = x / values[:, 0:1]  # (S, V)
    if "top_k" in use or "top_p" in use:
        sorted_x = sorted_descending(x)  # (S, V), one sort of the values serves both cuts
        if "top_k" in use:
            kth = sorted_x.gather(1, values[:, 1:2].long() - 1)  # (S, 1): the k-th largest logit
            x = x.masked_fill(x < kth, float("-inf"))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if "top_p" in use:
            x = x.masked_fill(x < top_p_cut(sorted_x, values[:, 2:3]), float("-inf"))
    if "min_p" in use:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < values[:, 3:4] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
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


def filters_used(params: SamplingParams, vocab_size: int) -> set[str]:
    used = set()
    if params.top_k is not None and params.top_k < vocab_size:
        used.add("top_k")
    if params.top_p not in (None, 1.0):
        used.add("top_p")
    if params.min_p:
        used.add("min_p")
    return used


def top_logprobs(logits: torch.Tensor, chosen_ids: torch.Tensor, n: int):
    """(L, V) raw logits -> the chosen ids' logprobs (L,) and the n most likely (values, ids) (L, n)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (L, V)
    chosen = logp.gather(1, chosen_ids[:, None])[:, 0]
    if n == 0:
        return chosen, None, None
    top = logp.topk(n, dim=-1)
    return chosen, top.values, top.indices


class Sampler:
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
        """(M, V) logits of the sequences that pick a token this step -> their ids, on the device."""
        device = self.device
        plan = self.plan(seqs)
        raw = logits.float()
        x = raw
        if plan.penalised or plan.bias is not None or plan.min_tokens:  # the filters read plan.values
            x = penalise(raw, seqs, plan, self.counts)
        if plan.constrained:  # after the penalties, before argmax and the filters
            x = self.grammar.apply(raw.clone() if x is raw else x, seqs)  # raw stays raw for the logprobs
        ids = x.argmax(dim=-1) if len(plan.sampled) < len(seqs) else None  # (M,): greedy rows keep theirs
        if plan.sampled:
            index = plan.sampled_index  # None: every row samples
            probs = torch.softmax(filtered(x if index is None else x[index],
                                           plan.values if index is None else plan.values[index], plan.use),
                                  dim=-1)  # (S, V)
            seeded = [(i, seqs[row].generator) for i, row in plan.seeded]  # each step: generators can be swapped
            drawn = draw(probs, seeded, unseeded=len(seeded) < len(plan.sampled))
            ids = drawn if index is None else ids.index_copy(0, index, drawn)
        if plan.penalised:  # count the new tokens where the next step's penalties will read them
            self.counts.output.index_put_((plan.count_rows, ids[plan.count_index]),
                                          torch.ones((), dtype=torch.int32, device=device), accumulate=True)
        out = Sampled(ids, plan.logprob_rows)
        if out.logprob_rows:
            rows = to_device(out.logprob_rows, torch.long, device)
            n = max(seqs[row].params.logprobs for row in out.logprob_rows)
            out.chosen, out.top_values, out.top_ids = top_logprobs(raw[rows], ids[rows], n)
        return out


@dataclass
class PromptLogprobs:
    """The rows of a step's packed batch whose logits score a prompt token, for the sequences that asked
    prompt_logprobs: row r (position p of its sequence) predicts prompt token p + 1, `targets`, and
    `owners` says (sequence, p + 1). Their logits are computed on these rows only (logits_at)."""

    rows: list[int]
    targets: list[int]
    owners: list[tuple[Sequence, int]]
    tensors: tuple | None = None  # (chosen (R,), top values (R, N), top ids (R, N)) once computed

    @classmethod
    def of(cls, scheduled: list[tuple[Sequence, int]]) -> PromptLogprobs:
        rows, targets, owners = [], [], []
        offset = 0  # where each sequence's tokens start in the packed row
        for seq, n in scheduled:
            if seq.needs_prompt_logprobs:
                start = seq.num_computed_tokens
                for p in range(start, min(start + n, seq.num_prompt_tokens - 1)):
                    rows.append(offset + p - start)
                    targets.append(seq.prompt_token_ids[p + 1])
                    owners.append((seq, p + 1))
            offset += n
        return cls(rows, targets, owners)

    def compute(self, logits: torch.Tensor) -> None:
        """(R, V) raw logits of self.rows -> the logprob tensors, still on the device."""
        n = max(seq.params.prompt_logprobs for seq, _ in self.owners)
        self.tensors = top_logprobs(logits, to_device(self.targets, torch.long, logits.device), n)


def read_back(out: Sampled | None, seqs: list[Sequence], prompt: PromptLogprobs) -> list[int]:
    """The step's one device -> host read: the (M,) ids, and with them (packed into the same copy, as
    float64, which holds token ids exactly) the logprobs asked for. Logprobs go onto their sequences
    (seq.output_logprobs, seq.prompt_logprobs); the ids are returned."""
    extras = []
    if out is not None and out.logprob_rows:
        extras += [t for t in (out.chosen, out.top_values, out.top_ids) if t is not None]
    if prompt.rows:
        extras += [t for t in prompt.tensors if t is not None]
    if not extras:
        return [] if out is None else out.ids.tolist()  # the one host read
    parts = ([] if out is None else [out.ids]) + extras
    flat = torch.cat([t.flatten().double() for t in parts]).tolist()  # the one host read
    M = len(seqs)
    ids = [int(i) for i in flat[:M]]
    at = M
    if out is not None and out.logprob_rows:
        rows = [(seqs[r], ids[r], seqs[r].params.logprobs) for r in out.logprob_rows]
        at = _attach(flat, at, rows, out.top_values, lambda seq, _, logprob: seq.output_logprobs.append(logprob))
    if prompt.rows:
        rows = [(seq, target, seq.params.prompt_logprobs) for (seq, _), target in
                zip(prompt.owners, prompt.targets, strict=True)]
        positions = [p for _, p in prompt.owners]
        _attach(flat, at, rows, prompt.tensors[1],
                lambda seq, i, logprob: seq.prompt_logprobs.__setitem__(positions[i], logprob))
    return ids


def _attach(flat: list[float], at: int, rows, top_values, put) -> int:
    """Unpack L rows of (chosen logprob, top-N values, top-N ids) from `flat` starting at `at`; hand each
    row's TokenLogprob to `put(seq, i, logprob)`. Returns where the next part starts."""
    L = len(rows)
    n = 0 if top_values is None else top_values.shape[1]
    chosen, values, ids = flat[at:at + L], flat[at + L:at + L + L * n], flat[at + L + L * n:at + L + 2 * L * n]
    for i, (seq, token, want) in enumerate(rows):
        top = tuple((int(ids[i * n + j]), values[i * n + j]) for j in range(want))
        put(seq, i, TokenLogprob(token, chosen[i], top))
    return at + L + 2 * L * n
