"""Choosing the next token: `SamplingParams` (checked once) and pure functions on logits (B, V).

Nothing here knows the model or the cache. Each filter takes logits and returns logits with the dropped
tokens set to -inf, so they compose:

    logits = apply_repetition_penalty(logits, previous_ids, 1.3)
    logits = top_p_filter(top_k_filter(logits / 0.8, 50), 0.9)
    next_ids = sample_from(logits, generator)

`sample_next` runs them in that order (penalty, then `filtered_logits`: temperature, top-k, top-p, min-p;
Hugging Face's order).
Every filter keeps at least the most likely token, so the softmax never sees a row of only -inf (no NaN).
The filters trust their arguments: `SamplingParams` checks the user's values once, where they come in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def _is_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


# field: (type test, what type, value test, what values) -- None is allowed for every optional field
_RULES = {
    "temperature": (_is_number, "a number", lambda v: math.isfinite(v) and v >= 0.0,
                    "a finite number >= 0 (0 means greedy)"),
    "top_k": (_is_int, "an int or None", lambda v: v >= 1, ">= 1"),
    "top_p": (_is_number, "a number or None", lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "min_p": (_is_number, "a number or None", lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "repetition_penalty": (_is_number, "a number or None", lambda v: math.isfinite(v) and v > 0.0,
                           "a finite number > 0 (1 = off)"),
    "max_tokens": (_is_int, "an int", lambda v: v >= 1, "a positive integer"),
    "ignore_eos": (lambda v: isinstance(v, bool), "a bool", lambda v: True, ""),
    "seed": (_is_int, "an int or None", lambda v: True, ""),
}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request (or one `generate` call).

    temperature 0 is greedy (the filters cannot change the argmax, so they are skipped). `max_tokens` new
    tokens at most; a request also stops at any of `stop_token_ids`, and at the model's EOS token unless
    `ignore_eos`. `seed` makes a sampled request reproducible on its own, whatever else runs beside it.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, (is_type, type_text, is_valid, values_text) in _RULES.items():
            value = getattr(self, name)
            if value is None and name not in ("temperature", "max_tokens", "ignore_eos"):
                continue
            if not is_type(value):
                raise TypeError(f"{name}={value!r} must be {type_text}")
            if not is_valid(value):
                raise ValueError(f"{name}={value} must be {values_text}")
        stops = self.stop_token_ids
        if not isinstance(stops, tuple | list) or not all(_is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids={stops!r} must be a list of non-negative token ids")
        object.__setattr__(self, "stop_token_ids", tuple(stops))  # a list is accepted, a tuple is kept

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def stops(self, eos_token_id: int | None) -> tuple[int, ...]:
        """Every token id that ends this request: the stop ids, plus EOS unless ignore_eos."""
        if eos_token_id is None or self.ignore_eos:
            return self.stop_token_ids
        return (*self.stop_token_ids, eos_token_id)

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded with `seed` (None: draw from torch's global generator)."""
        return None if self.seed is None else torch.Generator(device).manual_seed(self.seed)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any token tied with the k-th), set the rest to -inf.
    top_k >= V keeps every token."""
    if top_k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probabilities sum to >= top_p.

    Sorted by probability, a token is dropped when the tokens before it already reach top_p, so the
    token that crosses top_p is kept (and the most likely token always is)."""
    if top_p == 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    sorted_probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V): probability of the tokens ranked above
    drop_sorted = mass_before >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits.float(), dim=-1)  # (B, V)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values  # (B, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_repetition_penalty(
    logits: torch.Tensor,
    previous_ids: torch.Tensor,
    penalty: float,
    previous_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Make tokens already present in `previous_ids` (B, T) less likely (the CTRL rule):
    a positive logit is divided by `penalty`, a negative one multiplied by it. penalty 1 changes nothing.
    previous_mask (B, T), True = a real token, leaves padding out of the count."""
    B, V = logits.shape
    if previous_mask is None:
        previous_mask = torch.ones_like(previous_ids, dtype=torch.bool)
    counts = torch.zeros(B, V, dtype=torch.long, device=logits.device)
    counts.scatter_add_(1, previous_ids.long(), previous_mask.long())  # (B, V): how often each token was seen
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(counts > 0, penalised, logits)


def draw_from_probs(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one index per row with probability proportional to `weights` (B, V) >= 0: (B, V) -> (B,).

    The exponential race: argmax(w_i / E_i) with E_i ~ Exp(1) picks i with probability w_i / sum(w)
    (the smallest E_i / w_i wins, and E_i / w_i ~ Exp(w_i)), so the weights need not be normalised.
    Unlike torch.multinomial it never waits for the device, so a GPU decode loop runs without a sync
    (gpt-fast samples the same way)."""
    race = torch.empty_like(weights).exponential_(1.0, generator=generator)  # (B, V)
    return (weights / race).argmax(dim=-1)  # (B,)


def sample_from(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row from softmax(logits): (B, V) -> (B,), by draw_from_probs's race."""
    probs = torch.softmax(logits.float(), dim=-1)  # (B, V); dropped tokens have probability exactly 0
    return draw_from_probs(probs, generator)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(B, V) logits -> (B, V) float logits a sampled request (temperature > 0) draws from: temperature,
    then top-k, top-p, min-p; dropped tokens are -inf. The repetition penalty is not here (it needs the
    tokens seen so far): sample_next applies it first. Speculative decoding uses this same chain."""
    assert not params.greedy, "greedy decoding takes the argmax; there is nothing to filter"
    logits = logits.float() / params.temperature  # < 1 sharpens the distribution, > 1 flattens it
    if params.top_k is not None:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p is not None:
        logits = top_p_filter(logits, params.top_p)
    if params.min_p is not None and params.min_p > 0.0:
        logits = min_p_filter(logits, params.min_p)
    return logits


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    previous_ids: torch.Tensor | None = None,
    previous_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B, V) logits of the last position -> (B,) next token ids, chosen as `params` says.

    previous_ids (B, T) are the tokens seen so far (needed for the repetition penalty only)."""
    logits = logits.float()
    if params.repetition_penalty is not None and params.repetition_penalty != 1.0:
        assert previous_ids is not None, "the repetition penalty needs the tokens seen so far"
        logits = apply_repetition_penalty(logits, previous_ids, params.repetition_penalty, previous_mask)
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample_from(filtered_logits(logits, params), generator)
