"""What the sampler knows about a batch before seeing its logits: `BatchPlan`, built once per batch.

    RowParams    every row's sampling parameters as named (M, 1) tensors, neutral where a row skips a step
    Penalties    logit_bias, min_tokens and the penalties' rows in `TokenCounts` (None: no row has one)
    SampledRows  the rows that draw, their parameters, which filters some row uses, which rows are seeded
    LogprobRows  the rows asking logprobs (engine/logprobs.py)

`TokenCounts` is the device-side table of token counts the penalties read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..inference.sampling import SamplingParams
from .logprobs import LogprobRows, to_device
from .sequence import Sequence

_TOP_P_OFF = 2.0  # above any cumulative mass: keeps every token (top_p 1.0 could drop a tail by rounding)


class RowValues(NamedTuple):
    """One request's numbers for `RowParams` (cached per SamplingParams), neutral where it skips a step:
    temperature 1, top-k V, top-p off, min-p 0, penalties 1 / 0."""

    temperature: float
    top_k: float  # float32 holds ids < 2**24 exactly
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float


@functools.lru_cache(maxsize=4096)
def row_values(params: SamplingParams, vocab_size: int) -> RowValues:
    # greedy rows (temperature below SAMPLING_EPS, not just 0) take the argmax and never divide by it
    return RowValues(temperature=1.0 if params.greedy else params.temperature,
                     top_k=float(min(params.top_k or vocab_size, vocab_size)),
                     top_p=_TOP_P_OFF if params.top_p in (None, 1.0) else params.top_p,
                     min_p=params.min_p or 0.0,
                     repetition_penalty=params.repetition_penalty or 1.0,
                     presence_penalty=params.presence_penalty,
                     frequency_penalty=params.frequency_penalty)


@dataclass(frozen=True)
class RowParams:
    """Every row's parameters, one (M, 1) float32 tensor per name, so each step of the chain is one line
    over the whole batch (`x / params.temperature`). The tensors are column views of one (M, 7) `table`:
    one copy to the device, and one index to take some of the rows."""

    table: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor

    @classmethod
    def of(cls, params: list[SamplingParams], vocab_size: int, device: torch.device) -> RowParams:
        return cls.of_table(to_device([row_values(p, vocab_size) for p in params], torch.float32, device))

    @classmethod
    def of_table(cls, table: torch.Tensor) -> RowParams:
        """(M, 7) rows of RowValues -> the named (M, 1) columns."""
        return cls(table=table, **dict(zip(RowValues._fields, table.split(1, dim=1), strict=True)))

    def take(self, index: torch.Tensor) -> RowParams:
        """The parameters of the rows `index` (S,), in that order."""
        return RowParams.of_table(self.table[index])  # (S, 7)


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


@dataclass(frozen=True)
class Penalties:
    """What penalise() needs, for a batch where some row has a logit_bias, a min_tokens or a penalty."""

    params: RowParams  # every row's (the penalties are read from it)
    count_slots: torch.Tensor  # (M,) each row's TokenCounts row (0: the zero row)
    penalised_index: torch.Tensor  # (P,) the rows with a penalty, whose sampled ids are counted ...
    penalised_slots: torch.Tensor  # (P,) ... in these TokenCounts rows
    any_repetition: bool
    any_presence_frequency: bool
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, values of every logit_bias
    min_tokens_rows: list[int]  # their stop ids are banned while the output is shorter than min_tokens

    @classmethod
    def of(cls, seqs: list[Sequence], row_params: RowParams, counts: TokenCounts) -> Penalties | None:
        params = [seq.params for seq in seqs]
        penalised = [row for row, p in enumerate(params) if p.penalised]
        bias = [(row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias]
        min_tokens_rows = [row for row, p in enumerate(params) if p.min_tokens]
        if not (penalised or bias or min_tokens_rows):
            return None
        slots = [counts.row(seqs[row]) if row in penalised else 0 for row in range(len(seqs))]
        device, long = counts.device, torch.long
        rows, ids, values = zip(*bias, strict=True) if bias else ((), (), ())
        return cls(params=row_params, count_slots=to_device(slots, long, device),
                   penalised_index=to_device(penalised, long, device),
                   penalised_slots=to_device([slots[row] for row in penalised], long, device),
                   any_repetition=any(p.repetition_penalty not in (None, 1.0) for p in params),
                   any_presence_frequency=any(p.presence_penalty or p.frequency_penalty for p in params),
                   bias=(to_device(rows, long, device), to_device(ids, long, device),
                         to_device(values, torch.float32, device)) if bias else None,
                   min_tokens_rows=min_tokens_rows)

    @property
    def any_penalty(self) -> bool:
        return self.any_repetition or self.any_presence_frequency


@dataclass(frozen=True)
class SampledRows:
    """The rows that draw a token (the others take the argmax), and what their draw needs."""

    rows: list[int]
    index: torch.Tensor | None  # (S,) the rows on the device; None: every row of the batch draws
    params: RowParams  # of these rows only
    any_top_k: bool  # does some row use top-k? (the neutral values of the others keep every token)
    any_top_p: bool
    any_min_p: bool
    seeded: list[tuple[int, int]]  # (place among these rows, batch row) of the rows with their own generator

    @classmethod
    def of(cls, seqs: list[Sequence], row_params: RowParams, vocab_size: int) -> SampledRows | None:
        rows = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
        if not rows:
            return None
        every_row = len(rows) == len(seqs)
        params = [seqs[row].params for row in rows]
        index = None if every_row else to_device(rows, torch.long, row_params.table.device)
        return cls(rows=rows, index=index, params=row_params if index is None else row_params.take(index),
                   any_top_k=any(p.top_k is not None and p.top_k < vocab_size for p in params),
                   any_top_p=any(p.top_p not in (None, 1.0) for p in params),
                   any_min_p=any(bool(p.min_p) for p in params),
                   seeded=[(i, row) for i, row in enumerate(rows) if seqs[row].generator is not None])


@dataclass(frozen=True)
class BatchPlan:
    """What the sampler knows about a batch before seeing its logits. Nothing in it changes while the batch
    is the same sequences in the same order (a request's parameters and its count row are fixed for its
    life), and in a decode phase the batch IS the same step after step: the sampler builds the plan once
    and reuses it (vLLM's persistent batch, in small). What moves per step -- min_tokens (the output
    grows), the generators, the grammar's mask -- is read from the sequences each step."""

    seqs: tuple[Sequence, ...]
    penalties: Penalties | None  # None: no row has a logit_bias, a min_tokens or a penalty
    sampled: SampledRows | None  # None: every row is greedy
    logprob_rows: LogprobRows | None  # None: no row asks logprobs
    any_constrained: bool  # does some row follow a grammar (engine/structured.py)?

    @classmethod
    def of(cls, seqs: list[Sequence], counts: TokenCounts, vocab_size: int, device: torch.device) -> BatchPlan:
        row_params = RowParams.of([seq.params for seq in seqs], vocab_size, device)
        return cls(seqs=tuple(seqs), penalties=Penalties.of(seqs, row_params, counts),
                   sampled=SampledRows.of(seqs, row_params, vocab_size),
                   logprob_rows=LogprobRows.of(seqs, device),
                   any_constrained=any(seq.grammar is not None for seq in seqs))
