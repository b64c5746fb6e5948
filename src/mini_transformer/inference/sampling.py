"""Choosing the next token: `SamplingParams` (checked once) and pure functions on logits (B, V).

Nothing here knows the model or the cache. Each filter takes logits and returns logits with the dropped
tokens set to -inf, so they compose:

    logits = apply_repetition_penalty(logits, previous_ids, 1.3)
    logits = top_p_filter(top_k_filter(logits / 0.8, 50), 0.9)
    next_ids = sample_from(logits, generator)

`sample_next` runs them in this order (vLLM's order up to the filters, then Hugging Face's):
  `penalised_logits`: logit_bias, min_tokens (stop ids banned), repetition penalty, frequency and presence
                      penalties -- these change the greedy choice too;
  `filtered_logits`:  temperature, top-k, top-p, min-p -- sampled requests only.
Every filter keeps at least the most likely token, so the softmax never sees a row of only -inf (no NaN).
The filters trust their arguments: `SamplingParams` checks the user's values once, where they come in.
This is the one-row-at-a-time reference; the serving engine runs the same chain on a whole batch with
per-row parameters (engine/sampler.py), and its tests compare the two draw for draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._checks import boolean, integer, non_negative_int, number, positive_int, probability, token_ids
from ..model.fused_ops import argmax_rows
from .structured import StructuredOutput

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]
# A temperature below SAMPLING_EPS is greedy, as in vLLM (its _SAMPLING_EPS): dividing by a tinier one
# overflows float32 to inf, the softmax turns inf into NaN, and the draw returns token 0.
SAMPLING_EPS = 1e-5
# The largest temperature and repetition penalty (and the inverse of the smallest penalty): within them,
# finite logits stay finite through every step of the chain, in float32.
MAX_SAMPLING_FACTOR = 1e6


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request (or one `generate` call).

    temperature 0 is greedy (the filters cannot change the argmax, so they are skipped), and so is any
    temperature below SAMPLING_EPS; the largest is MAX_SAMPLING_FACTOR. `max_tokens` new
    tokens at most; a request also stops at any of `stop_token_ids`, and at the model's EOS token unless
    `ignore_eos`. `seed` makes a sampled request reproducible on its own, whatever else runs beside it.

    The OpenAI-style adjustments (they apply to greedy requests too):
      presence_penalty, frequency_penalty  logit -= presence * (count > 0) + frequency * count, where count
          is how often the token was GENERATED so far (OpenAI's definition: the prompt does not count).
          `repetition_penalty` differs twice: it divides a positive logit (multiplies a negative one)
          instead of subtracting, and, as in vLLM and Hugging Face, it counts prompt AND output tokens.
      logit_bias   {token id: bias} added to the logits, bias in [-100, 100]; -100 bans a token in
                   practice. Kept as sorted (id, bias) pairs, so SamplingParams stays hashable.
      min_tokens   the stop ids (and EOS unless ignore_eos) cannot be drawn before this many tokens.
    Log-probabilities (engine only; both of the RAW model distribution, log_softmax of the logits before
    any penalty, bias or temperature -- vLLM's default):
      logprobs         N: each new token's logprob and the N most likely alternatives (0: the token's only)
      prompt_logprobs  N: the same for every prompt token but the first
    Structured output (engine only): `structured`, a StructuredOutput (JSON schema, JSON object, regex,
    choice or EBNF grammar); each step masks the tokens the grammar cannot take next. The grammar decides
    where the output ends, so it does not combine with ignore_eos or min_tokens.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        number("temperature", self.temperature, low=0.0, high=MAX_SAMPLING_FACTOR,
               expected=f"a finite number >= 0 and <= {MAX_SAMPLING_FACTOR:g} (below {SAMPLING_EPS:g}: greedy)")
        if self.top_k is not None:
            positive_int("top_k", self.top_k)
        if self.top_p is not None:
            probability("top_p", self.top_p, zero=False)
        if self.min_p is not None:
            probability("min_p", self.min_p)
        if self.repetition_penalty is not None:
            number("repetition_penalty", self.repetition_penalty, low=1 / MAX_SAMPLING_FACTOR,
                   high=MAX_SAMPLING_FACTOR,
                   expected=f"a finite number > 0 in [{1 / MAX_SAMPLING_FACTOR:g}, {MAX_SAMPLING_FACTOR:g}] (1 = off)")
        positive_int("max_tokens", self.max_tokens)
        boolean("ignore_eos", self.ignore_eos)
        if self.seed is not None:
            integer("seed", self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            number(name, getattr(self, name), low=-2.0, high=2.0, expected="in [-2, 2] (OpenAI's range)")
        non_negative_int("min_tokens", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):  # 0: the chosen (or each prompt) token's own only
            if getattr(self, name) is not None:
                non_negative_int(name, getattr(self, name))
        stops = token_ids("stop_token_ids", self.stop_token_ids, empty=True)  # the vocabulary: the engine's door
        object.__setattr__(self, "stop_token_ids", tuple(stops))  # a list is accepted, a tuple is kept
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise TypeError(f"structured={self.structured!r} must be a StructuredOutput or None")
            if self.ignore_eos:
                raise ValueError("ignore_eos=True cannot be combined with structured output: the grammar decides "
                                 "where the output ends")
            if self.min_tokens:
                raise ValueError(f"min_tokens={self.min_tokens} cannot be combined with structured output: the "
                                 "grammar decides where the output ends")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalised(self) -> bool:
        """Does the choice depend on the tokens seen so far (repetition, presence or frequency penalty)?"""
        return self.repetition_penalty not in (None, 1.0) or bool(self.presence_penalty or self.frequency_penalty)

    def stops(self, eos_token_id: int | None) -> tuple[int, ...]:
        """Every token id that ends this request: the stop ids, plus EOS unless ignore_eos."""
        if eos_token_id is None or self.ignore_eos:
            return self.stop_token_ids
        return (*self.stop_token_ids, eos_token_id)

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded with `seed` (None: draw from torch's global generator)."""
        return None if self.seed is None else torch.Generator(device).manual_seed(self.seed)


def _checked_logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (or (id, bias) pairs) -> sorted pairs; ids >= 0, biases finite in [-100, 100].
    Whether an id is inside the vocabulary is checked where the model is known (engine, generate)."""
    if isinstance(bias, dict):
        bias = tuple(bias.items())
    if not isinstance(bias, tuple | list) or not all(isinstance(p, tuple | list) and len(p) == 2 for p in bias):
        raise TypeError(f"logit_bias={bias!r} must be a dict of token id -> bias")
    pairs = [(non_negative_int("logit_bias token id", token),
              number(f"logit_bias[{token}]", value, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)) for token, value in bias]
    if len({token for token, _ in pairs}) != len(pairs):
        raise ValueError(f"logit_bias={bias!r} names a token id twice")
    return tuple(sorted(pairs))


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any token tied with the k-th), set the rest to -inf.
    top_k >= V keeps every token."""
    if top_k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def sorted_descending(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B, V): each row's values, largest first.

    The filters need the sorted values only (top-k's and top-p's cuts are thresholds), not the order.
    On the CPU numpy sorts values alone and shares the tensor's memory; torch.sort also builds the
    permutation, which costs more than the sort itself."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        return torch.from_numpy(np.sort(logits.numpy(), axis=-1)[:, ::-1].copy())
    return torch.sort(logits, dim=-1, descending=True).values


def top_p_cut(sorted_logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """(B, V) logits sorted descending -> (B, 1) the smallest logit the nucleus keeps.

    A token is kept while the tokens ranked above it hold less than top_p, so the token that crosses
    top_p is kept, and the most likely token always is. top_p: a float or a (B, 1) tensor."""
    probs = torch.softmax(sorted_logits.float(), dim=-1)  # (B, V)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V): probability of the tokens ranked above
    # (B, 1); at least the most likely token even for a top_p that rounds to 0 in float32 (5e-324)
    n_kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_min(1)
    return sorted_logits.gather(-1, n_kept - 1)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probabilities sum to >= top_p (and
    any token tied with the last one kept, as top_k_filter keeps ties), set the rest to -inf."""
    if top_p == 1.0:
        return logits
    return logits.masked_fill(logits < top_p_cut(sorted_descending(logits), top_p), float("-inf"))


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
    counts = token_counts(previous_ids, logits.shape[-1], previous_mask)  # (B, V): how often each token was seen
    return repetition_penalised(logits, counts > 0, penalty)


def repetition_penalised(logits: torch.Tensor, seen: torch.Tensor, penalty) -> torch.Tensor:
    """The CTRL rule on the tokens `seen` (B, V) bool: positive logits / penalty, negative ones * penalty.
    penalty is a number or a (B, 1) per-row tensor (the engine's batched sampler)."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def draw_from_probs(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one index per row with probability proportional to `weights` (B, V) >= 0: (B, V) -> (B,).

    The exponential race: argmax(w_i / E_i) with E_i ~ Exp(1) picks i with probability w_i / sum(w)
    (the smallest E_i / w_i wins, and E_i / w_i ~ Exp(w_i)), so the weights need not be normalised.
    Unlike torch.multinomial it never waits for the device, so a GPU decode loop runs without a sync
    (gpt-fast samples the same way)."""
    return (weights / exponential_noise(weights, generator)).argmax(dim=-1)  # (B,)


def exponential_noise(like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Exp(1) draws shaped like `like`, as -log(U) with U uniform: on the CPU cheaper than
    Tensor.exponential_. U = 0 gives +inf, a token that loses the race."""
    return torch.empty_like(like, dtype=torch.float32).uniform_(generator=generator).log_().neg_()


def sample_from(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row from softmax(logits): (B, V) -> (B,), by draw_from_probs's race."""
    probs = torch.softmax(logits.float(), dim=-1)  # (B, V); dropped tokens have probability exactly 0
    return draw_from_probs(probs, generator)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(B, V) logits -> (B, V) float logits a sampled request (not greedy) draws from: temperature,
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


def token_counts(ids: torch.Tensor, vocab_size: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) token ids -> (B, V) how often each token occurs in its row; mask (B, T) True = counted."""
    counts = torch.zeros(ids.shape[0], vocab_size, dtype=torch.long, device=ids.device)
    ones = torch.ones_like(ids) if mask is None else mask.long()
    return counts.scatter_add_(1, ids.long(), ones)


def apply_presence_frequency(logits: torch.Tensor, output_counts: torch.Tensor, presence, frequency) -> torch.Tensor:
    """OpenAI's penalties: logits - (frequency * count + presence * (count > 0)), count (B, V) = how often
    each token was generated so far. presence and frequency are numbers, or (B, 1) per-row tensors."""
    counts = output_counts.to(logits.dtype)
    return logits - (frequency * counts + presence * (output_counts > 0).to(logits.dtype))


def penalised_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    previous_ids: torch.Tensor | None = None,
    previous_mask: torch.Tensor | None = None,
    output_ids: torch.Tensor | None = None,
    stop_ids: tuple[int, ...] = (),
) -> torch.Tensor:
    """(B, V) logits -> (B, V) float logits after the adjustments that also change a greedy choice, in
    vLLM's order: logit_bias, min_tokens, repetition penalty, frequency and presence penalties.

    previous_ids (B, T): every token so far, prompt included (the repetition penalty's count);
    output_ids (B, G): the tokens generated so far (presence/frequency count them; G is min_tokens' count);
    stop_ids: the ids min_tokens bans (the request's stop ids and EOS)."""
    logits = logits.float()
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        logits = logits.clone()
        logits[:, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    num_generated = 0 if output_ids is None else output_ids.shape[1]
    if num_generated < params.min_tokens and stop_ids:
        logits = logits.index_fill(1, torch.tensor(stop_ids, device=logits.device), float("-inf"))
    if params.repetition_penalty is not None and params.repetition_penalty != 1.0:
        assert previous_ids is not None, "the repetition penalty needs the tokens seen so far"
        logits = apply_repetition_penalty(logits, previous_ids, params.repetition_penalty, previous_mask)
    if params.presence_penalty or params.frequency_penalty:
        assert output_ids is not None, "presence and frequency penalties need the tokens generated so far"
        counts = token_counts(output_ids, logits.shape[-1])
        logits = apply_presence_frequency(logits, counts, params.presence_penalty, params.frequency_penalty)
    return logits


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    previous_ids: torch.Tensor | None = None,
    previous_mask: torch.Tensor | None = None,
    output_ids: torch.Tensor | None = None,
    stop_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B, V) logits of the last position -> (B,) next token ids, chosen as `params` says.

    previous_ids, previous_mask, output_ids and stop_ids feed the penalties and min_tokens (see
    penalised_logits); a request that uses none of them needs none of them."""
    logits = penalised_logits(logits, params, previous_ids=previous_ids, previous_mask=previous_mask,
                              output_ids=output_ids, stop_ids=stop_ids)
    if params.greedy:
        return argmax_rows(logits)  # the C++ one-pass argmax on CPU fp32, else torch.argmax
    return sample_from(filtered_logits(logits, params), generator)
