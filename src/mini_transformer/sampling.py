"""Choosing the next token: pure functions on logits (B, V), nothing here knows the model or the cache.

Each filter takes logits and returns logits with the dropped tokens set to -inf, so they compose:

    logits = apply_repetition_penalty(logits, previous_ids, 1.3)
    logits = top_p_filter(top_k_filter(apply_temperature(logits, 0.8), 50), 0.9)
    next_ids = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)

`sample_next` runs them in that order (penalty, temperature, top-k, top-p, min-p; Hugging Face's order).
Every filter keeps at least the most likely token, so the softmax never sees a row of only -inf (no NaN).
"""

from __future__ import annotations

import math

import torch


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def check_sampling_args(
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
) -> None:
    """Raise ValueError (TypeError for a wrong type) naming the first bad argument."""
    if not _is_number(temperature):
        raise TypeError(f"temperature={temperature!r} must be a number")
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 (0 means greedy)")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError(f"top_k={top_k!r} must be an int or None")
        if top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1")
    if top_p is not None:
        if not _is_number(top_p):
            raise TypeError(f"top_p={top_p!r} must be a number or None")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if min_p is not None:
        if not _is_number(min_p):
            raise TypeError(f"min_p={min_p!r} must be a number or None")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p={min_p} must be in [0, 1]")
    if repetition_penalty is not None:
        if not _is_number(repetition_penalty):
            raise TypeError(f"repetition_penalty={repetition_penalty!r} must be a number or None")
        if not (math.isfinite(repetition_penalty) and repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty={repetition_penalty} must be a finite number > 0 (1 = off)")


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a 2-D float tensor (B, V), got {shape}")


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,) the most likely token of each row (the first one on a tie)."""
    _check_logits(logits)
    return logits.argmax(dim=-1)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature: < 1 sharpens the distribution, > 1 flattens it. 0 is greedy, not a division."""
    check_sampling_args(temperature=temperature)
    if temperature == 0.0:
        raise ValueError("temperature=0 means greedy decoding; call greedy(logits) instead of dividing by 0")
    return logits / temperature


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any token tied with the k-th), set the rest to -inf.
    top_k >= V keeps every token."""
    check_sampling_args(top_k=top_k)
    _check_logits(logits)
    if top_k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probabilities sum to >= top_p.

    Sorted by probability, a token is dropped when the tokens before it already reach top_p, so the
    token that crosses top_p is kept (and the most likely token always is)."""
    check_sampling_args(top_p=top_p)
    _check_logits(logits)
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
    check_sampling_args(min_p=min_p)
    _check_logits(logits)
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
    check_sampling_args(repetition_penalty=penalty)
    _check_logits(logits)
    B, V = logits.shape
    if not isinstance(previous_ids, torch.Tensor) or previous_ids.dim() != 2 or previous_ids.shape[0] != B:
        shape = tuple(previous_ids.shape) if isinstance(previous_ids, torch.Tensor) else type(previous_ids).__name__
        raise ValueError(f"previous_ids must be (B, T) with B={B} like logits, got {shape}")
    if previous_mask is None:
        previous_mask = torch.ones_like(previous_ids, dtype=torch.bool)
    elif tuple(previous_mask.shape) != tuple(previous_ids.shape):
        raise ValueError(
            f"previous_mask has shape {tuple(previous_mask.shape)}, "
            f"expected {tuple(previous_ids.shape)} like previous_ids"
        )
    counts = torch.zeros(B, V, dtype=torch.long, device=logits.device)
    counts.scatter_add_(1, previous_ids.long(), previous_mask.long())  # (B, V): how often each token was seen
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(counts > 0, penalised, logits)


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    previous_ids: torch.Tensor | None = None,
    previous_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B, V) logits of the last position -> (B,) next token ids.

    temperature 0 is greedy (top-k/top-p/min-p cannot change the argmax, so they are skipped);
    otherwise the filters run in order and one token per row is drawn with `generator`."""
    check_sampling_args(temperature, top_k, top_p, min_p, repetition_penalty)
    _check_logits(logits)
    logits = logits.float()
    if repetition_penalty is not None and repetition_penalty != 1.0:
        if previous_ids is None:
            raise ValueError("repetition_penalty needs previous_ids (B, T): the tokens seen so far")
        logits = apply_repetition_penalty(logits, previous_ids, repetition_penalty, previous_mask)
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = apply_temperature(logits, temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    if min_p is not None and min_p > 0.0:
        logits = min_p_filter(logits, min_p)
    probs = torch.softmax(logits, dim=-1)  # (B, V); dropped tokens have probability exactly 0
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)  # (B,)
