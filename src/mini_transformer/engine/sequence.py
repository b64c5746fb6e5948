"""Sequence: one request as the engine sees it — its tokens, how far they are computed, its blocks.

    tokens = prompt_token_ids + output_token_ids
    num_computed_tokens: how many of `tokens` have their K/V in the pool already

A step schedules `num_tokens - num_computed_tokens` tokens or fewer (a prefill chunk); a running
sequence whose last token is its newest sampled one schedules exactly 1 (a decode step). vLLM V1 makes
no other distinction between prefill and decode, and neither do we.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..inference.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the RAW model distribution (log_softmax of the logits, before
    penalties, logit_bias or temperature: vLLM's default), and the `top` N most likely tokens at that
    position as (token id, logprob), most likely first (N = SamplingParams.logprobs / prompt_logprobs)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: the token(s) it added, and whether it is done.
    finish_reason: None while running, "stop" (a stop or EOS token, or the end of its grammar), "length"
    (max_tokens; a constrained output cut there is incomplete), "abort", or "error" (the step's forward
    pass raised, see LLMEngine.step; or a grammar left no token to choose).
    logprobs: one TokenLogprob per new token when SamplingParams.logprobs is set, else None.
    prompt_logprobs: one per prompt token (the first is None: nothing predicts it) when
    SamplingParams.prompt_logprobs is set, delivered once, with the request's first output; else None."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 stop_token_ids: tuple[int, ...], arrival: int, device: torch.device):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.stop_token_ids = frozenset(stop_token_ids)
        self.arrival = arrival  # FCFS order: the order add_request saw
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []  # block ids, in the order of the tokens they hold
        self.block_hashes: list[int] = []  # hash chain of the full blocks of `tokens` (see BlockManager)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at the last admission
        self.generator = params.make_generator(device)  # its own random stream: batch-independent
        # filled by the engine's sampler (engine/sampler.py) when the params ask for them
        self.output_logprobs: list[TokenLogprob] = []  # one per output token
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if params.prompt_logprobs is None else [None] * len(self.prompt_token_ids))
        self.prompt_logprobs_sent = False  # they go out once, with the first output
        self.grammar = None  # an xgrammar GrammarMatcher when params.structured is set (engine/structured.py)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Must this step's prompt rows go through the head (prompt_logprobs asked, not yet sent)?"""
        return self.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building `tokens` whole: a decode step reads one token of a long
        sequence every step."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - prompt_len)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> bool:
        """Add a sampled token and finish the sequence if it is a stop token, ends its grammar, or is the last
        one allowed. A constrained sequence's matcher advances here, once per token; a token its grammar
        refuses (possible only when the mask left no token at all) is not added, and the sequence ends with
        finish_reason "error". Returns whether the token was added."""
        if self.grammar is not None and not self.grammar.accept_token(token_id):
            self.finish("error")
            return False
        self.output_token_ids.append(token_id)
        if token_id in self.stop_token_ids or (self.grammar is not None and self.grammar.is_terminated()):
            self.finish("stop")
        elif len(self.output_token_ids) >= self.params.max_tokens:
            self.finish("length")
        return True

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
