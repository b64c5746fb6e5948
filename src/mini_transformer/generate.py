"""Autoregressive generation: prefill the prompt once, then decode one token at a time from the KV cache.

    new_ids = generate(model, idx, 50, temperature=0.8, top_k=40, attention_mask=mask, eos_token_id=0)

Prompts of different lengths share a batch by LEFT padding (`attention_mask` 0 = padding): every row's
last prompt token then sits in the last column, so one decode step serves all rows. The model gives a
left-padded row positions 0, 1, ... from its first real token, so padding never changes its tokens.

`use_cache=False` is the naive loop (the seed's `generate`): every step runs the whole sequence again,
O(T^2) work per token instead of O(T). It exists to check the cache and to measure what it buys.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .kv_cache import KVCache
from .sampling import check_sampling_args, sample_next
from .transformer import TransformerLM, check_token_ids


def prefill(model: TransformerLM, idx: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None):
    """Run the whole prompt (B, T) once, filling the cache. Returns the last position's logits (B, V)."""
    logits, _ = model(idx, attention_mask=attention_mask, cache=cache)  # (B, T, V)
    return logits[:, -1]


def decode_step(model: TransformerLM, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run one new token per row (B,) against the cached keys/values. Returns its logits (B, V)."""
    logits, _ = model(token[:, None], cache=cache)  # (B, 1, V)
    return logits[:, -1]


def _check_generate_args(model, idx, max_new_tokens, attention_mask, eos_token_id, stream) -> None:
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    cfg = model.config
    B, T = check_token_ids(idx)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    if T + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt length {T} + max_new_tokens {max_new_tokens} = {T + max_new_tokens} exceeds "
            f"max_seq_len={cfg.max_seq_len}; shorten the prompt or ask for fewer tokens"
        )
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, T):
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"attention_mask has shape {shape}, expected (B, T) = {(B, T)} like idx")
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
        keep = attention_mask.bool()
        if not bool(keep[:, -1].all()):
            raise ValueError("attention_mask must end with a real token in every row: pad prompts on the LEFT")
        if bool((keep[:, 1:] < keep[:, :-1]).any()):
            raise ValueError("attention_mask has padding after a real token; pad prompts on the LEFT only")
    if eos_token_id is not None:
        if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int):
            raise TypeError(f"eos_token_id={eos_token_id!r} must be an int or None")
        if not 0 <= eos_token_id < cfg.vocab_size:
            raise ValueError(f"eos_token_id={eos_token_id} is outside [0, vocab_size={cfg.vocab_size})")
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be a callable taking the (B,) tokens of each step, got {type(stream).__name__}")


@torch.inference_mode()
def generate(
    model: TransformerLM,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    eos_token_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    stream: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Continue the prompts idx (B, T). Returns the new ids only, (B, max_new_tokens).

    temperature 0 = greedy; otherwise sampling with the filters of `sampling.sample_next`.
    A row that produces `eos_token_id` stops there; its later slots hold eos_token_id, and the loop
    ends early once every row has stopped. `stream(tokens)` is called after each step with (B,) ids.
    The model runs in eval mode (no dropout) and is put back in its previous mode afterwards.
    """
    _check_generate_args(model, idx, max_new_tokens, attention_mask, eos_token_id, stream)
    check_sampling_args(temperature, top_k, top_p, min_p, repetition_penalty)
    B, T = idx.shape
    device = idx.device
    # Every token so far (prompt + new) and which of them are real: the no-cache path re-runs them,
    # the repetition penalty looks at them.
    tokens = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=device)
    tokens[:, :T] = idx
    keep = torch.ones(B, T + max_new_tokens, dtype=torch.bool, device=device)
    if attention_mask is not None:
        keep[:, :T] = attention_mask.bool()
    prompt_mask = attention_mask if attention_mask is not None and not bool(keep[:, :T].all()) else None
    finished = torch.zeros(B, dtype=torch.bool, device=device)

    was_training = model.training
    model.eval()
    try:
        if use_cache:
            dtype = model.tok_emb.weight.dtype
            cache = KVCache.for_model(model.config, B, T + max_new_tokens, dtype=dtype, device=device)
            logits = prefill(model, idx, cache, prompt_mask)
        else:
            logits = model(idx, attention_mask=prompt_mask)[0][:, -1]
        for step in range(max_new_tokens):
            length = T + step
            next_ids = sample_next(
                logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repetition_penalty, previous_ids=tokens[:, :length],
                previous_mask=keep[:, :length], generator=generator,
            )  # (B,)
            if eos_token_id is not None:
                next_ids = next_ids.masked_fill(finished, eos_token_id)  # a stopped row only repeats EOS
                finished |= next_ids == eos_token_id
            tokens[:, length] = next_ids
            if stream is not None:
                stream(next_ids)
            if step == max_new_tokens - 1 or (eos_token_id is not None and bool(finished.all())):
                break
            if use_cache:
                logits = decode_step(model, next_ids, cache)
            else:  # the naive way: the whole sequence again, to read one new row of logits
                mask = keep[:, :length + 1] if prompt_mask is not None else None
                logits = model(tokens[:, :length + 1], attention_mask=mask)[0][:, -1]
    finally:
        model.train(was_training)
    new_ids = tokens[:, T:]
    if eos_token_id is not None:  # rows stopped early: fill what was never generated with EOS
        new_ids[:, step + 1:] = eos_token_id
    return new_ids.clone()


def generate_long(
    model: TransformerLM,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    keep_tokens: int | None = None,
    eos_token_id: int | None = None,
    stream: Callable[[torch.Tensor], None] | None = None,
    **sampling,
) -> torch.Tensor:
    """Continue one unpadded batch past the model's context length. Returns the new ids (B, <= max_new_tokens).

    Generation runs in chunks: fill the context with `generate` (KV cache), then keep only the last
    `keep_tokens` tokens (default: half the context), prefill them into a fresh cache, and go on.
    Each token therefore sees between keep_tokens and max_seq_len tokens of history. `sampling` takes
    the keyword arguments of `generate` (temperature, top_k, top_p, min_p, repetition_penalty, generator).
    """
    context = model.config.max_seq_len
    keep_tokens = context // 2 if keep_tokens is None else keep_tokens
    if isinstance(keep_tokens, bool) or not isinstance(keep_tokens, int) or not 1 <= keep_tokens < context:
        raise ValueError(f"keep_tokens={keep_tokens!r} must be an integer in [1, max_seq_len={context})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    if "attention_mask" in sampling:
        raise ValueError("generate_long takes unpadded prompts only (no attention_mask); generate one row at a time")
    window = idx[:, -context + 1:] if idx.shape[1] >= context else idx  # at least one slot left to generate
    chunks: list[torch.Tensor] = []
    produced = 0
    while produced < max_new_tokens:
        n = min(max_new_tokens - produced, context - window.shape[1])
        new = generate(model, window, n, eos_token_id=eos_token_id, stream=stream, **sampling)  # (B, n)
        chunks.append(new)
        produced += n
        if eos_token_id is not None and bool((new == eos_token_id).any(dim=-1).all()):
            break  # every row has stopped
        window = torch.cat([window, new], dim=1)[:, -keep_tokens:]  # (B, keep_tokens)
    return torch.cat(chunks, dim=1)
