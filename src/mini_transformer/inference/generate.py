"""Autoregressive generation: prefill the prompt once, then decode one token at a time from the KV cache.

    new_ids = generate(model, idx, SamplingParams(max_tokens=50, temperature=0.8, top_k=40), attention_mask=mask)
    new_ids = generate(model, idx, 50, temperature=0.8, top_k=40)      # the same call, keywords form

Prompts of different lengths share a batch by LEFT padding (`attention_mask` 0 = padding): every row's
last prompt token then sits in the last column, so one decode step serves all rows. The model gives a
left-padded row positions 0, 1, ... from its first real token, so padding never changes its tokens.

One loop serves every mode: a decoder (decoders.py) answers `prefill(idx, mask)` and `step(token)`, the
loop samples between them. `use_cache=False` picks the naive decoder: every step runs the whole sequence
again, O(T^2) work per token instead of O(T); it exists to check the cache and to measure what it buys.
`compile=True` picks static_cache.CompiledDecoder; `draft_model` hands the call to speculative.py.

This is one static batch (the learner's version); `engine/` serves many requests that come and go.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .._checks import boolean, instance, integer, positive_int, token_id, token_ids
from ..model.transformer import TransformerLM, check_attention_mask, check_token_ids
from .decoders import CachedDecoder, RecomputeDecoder
from .sampling import SamplingParams, sample_next
from .speculative import speculative_generate
from .static_cache import CompiledDecoder


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """generate()'s keywords besides the sampling ones, carried as one object to the loop and to
    generate_long's chunks. `generator=None`: one made from params.seed when decoding starts."""

    attention_mask: torch.Tensor | None = None
    eos_token_id: int | None = None
    use_cache: bool = True
    generator: torch.Generator | None = None
    stream: Callable[[torch.Tensor], None] | None = None
    compile: bool = False
    draft_model: TransformerLM | str | None = None
    num_speculative_tokens: int = 4


def as_sampling_params(params: SamplingParams | int, sampling: dict) -> SamplingParams:
    """generate's two call forms, one object: SamplingParams as given, or max_new_tokens + keywords."""
    if isinstance(params, SamplingParams):
        if sampling:
            raise TypeError(f"pass sampling options inside SamplingParams, not also as keywords: {sorted(sampling)}")
        return params
    if isinstance(params, bool) or not isinstance(params, int):
        raise TypeError(f"expected SamplingParams or max_new_tokens (an int), got {params!r}")
    positive_int("max_new_tokens", params)
    known = {f.name for f in dataclasses.fields(SamplingParams)} - {"max_tokens"}
    unknown = sorted(set(sampling) - known)
    if unknown:
        raise TypeError(f"generate() got unknown keyword arguments {unknown}; sampling options are {sorted(known)}")
    return SamplingParams(max_tokens=params, **sampling)


def _check_generate_args(model, idx, params: SamplingParams, options: DecodeOptions) -> None:
    attention_mask, eos_token_id, stream = options.attention_mask, options.eos_token_id, options.stream
    instance("model", model, TransformerLM)
    model.check_backend(training=False)  # generate runs the model in eval mode
    cfg = model.config
    B, T = check_token_ids(idx, cfg.vocab_size)
    if T + params.max_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt length {T} + max_new_tokens {params.max_tokens} = {T + params.max_tokens} exceeds "
            f"max_seq_len={cfg.max_seq_len}; shorten the prompt or ask for fewer tokens"
        )
    if attention_mask is not None:
        check_attention_mask(attention_mask, (B, T))
        keep = attention_mask.bool()
        if not bool(keep[:, -1].all()):
            raise ValueError("attention_mask must end with a real token in every row: pad prompts on the LEFT")
        if bool((keep[:, 1:] < keep[:, :-1]).any()):
            raise ValueError("attention_mask has padding after a real token; pad prompts on the LEFT only")
    if eos_token_id is not None:
        token_id("eos_token_id", eos_token_id, cfg.vocab_size)
    token_ids("stop_token_ids", params.stop_token_ids, cfg.vocab_size, empty=True)
    if params.logit_bias and params.logit_bias[-1][0] >= cfg.vocab_size:  # pairs are sorted by token id
        raise ValueError(f"logit_bias names token {params.logit_bias[-1][0]}, outside [0, vocab_size={cfg.vocab_size})")
    if params.logprobs is not None or params.prompt_logprobs is not None:
        raise ValueError("logprobs and prompt_logprobs are returned by the engine (LLMEngine), not by generate()")
    if params.structured is not None:
        raise ValueError("structured output (a grammar mask per step) runs in the engine (LLMEngine), not in "
                         "generate(); speculative decoding with a constraint is refused (drafts are not checked "
                         "against the mask)")
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be a callable taking the (B,) tokens of each step, got {type(stream).__name__}")
    boolean("compile", options.compile)
    if options.compile and not options.use_cache:
        raise ValueError("compile=True decodes from a static KV cache; it cannot be combined with use_cache=False")
    if options.draft_model is not None and (options.compile or not options.use_cache or attention_mask is not None):
        raise ValueError("draft_model: speculative decoding runs one unpadded row from the KV cache "
                         "(no compile, no use_cache=False, no attention_mask)")


@torch.inference_mode()
def generate(
    model: TransformerLM,
    idx: torch.Tensor,
    params: SamplingParams | int,
    *,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    stream: Callable[[torch.Tensor], None] | None = None,
    compile: bool = False,
    draft_model: TransformerLM | str | None = None,
    num_speculative_tokens: int = 4,
    **sampling,
) -> torch.Tensor:
    """Continue the prompts idx (B, T). Returns the new ids only, (B, params.max_tokens).

    `params` is a SamplingParams, or max_new_tokens with the sampling options as keywords (temperature,
    top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias, min_tokens,
    stop_token_ids, ignore_eos, seed). A row that produces a
    stop token (or `eos_token_id`, unless ignore_eos) stops there and repeats that token in its later
    slots; the loop ends early once every row has stopped. `generator` (or params.seed) drives sampling.
    `stream(tokens)` is called after each step with the (B,) new ids. The model runs in eval mode
    (no dropout) and is put back in its previous mode afterwards.

    `compile=True` decodes from a fixed-shape `StaticCache` with a step compiled once (static_cache.py).
    `draft_model` (a smaller TransformerLM, or "prompt_lookup" for n-grams copied from the context)
    turns on speculative decoding, `num_speculative_tokens` drafted per target pass (speculative.py).
    """
    params = as_sampling_params(params, sampling)
    options = DecodeOptions(attention_mask=attention_mask, eos_token_id=eos_token_id, use_cache=use_cache,
                            generator=generator, stream=stream, compile=compile, draft_model=draft_model,
                            num_speculative_tokens=num_speculative_tokens)
    _check_generate_args(model, idx, params, options)
    return decode(model, idx, params, options)


@torch.inference_mode()
def decode(model: TransformerLM, idx: torch.Tensor, params: SamplingParams, options: DecodeOptions) -> torch.Tensor:
    """generate's work, on arguments its door has checked (generate_long's later chunks come here too):
    the new ids (B, params.max_tokens). The model runs in eval mode, then goes back to its mode."""
    if options.draft_model is not None:
        return speculative_generate(model, idx, params, options.draft_model, options.num_speculative_tokens,
                                    eos_token_id=options.eos_token_id, generator=options.generator,
                                    stream=options.stream)
    B, T = idx.shape
    if not options.use_cache:
        decoder = RecomputeDecoder(model)
    elif options.compile:
        decoder = CompiledDecoder(model, B, T + params.max_tokens, idx.device)
    else:
        decoder = CachedDecoder(model, B, T + params.max_tokens, idx.device)
    was_training = model.training
    model.eval()
    try:
        return _sample_loop(decoder, idx, params, options)
    finally:
        model.train(was_training)


def _sample_loop(decoder, idx: torch.Tensor, params: SamplingParams, options: DecodeOptions) -> torch.Tensor:
    """The decode loop: prefill, then sample a token per row and step the decoder with it, max_tokens times."""
    B, T = idx.shape
    n_new, device = params.max_tokens, idx.device
    generator = params.make_generator(device) if options.generator is None else options.generator
    # Every token so far (prompt + new) and which of them are real: the penalties look at them.
    tokens = torch.empty(B, T + n_new, dtype=torch.long, device=device)
    tokens[:, :T] = idx
    keep = torch.ones(B, T + n_new, dtype=torch.bool, device=device)
    mask = options.attention_mask
    if mask is not None:
        keep[:, :T] = mask.bool()
        mask = None if bool(keep[:, :T].all()) else mask  # no padding: attention needs no mask
    stop_ids = params.stops(options.eos_token_id)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)  # (S,)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    logits = decoder.prefill(idx, mask)  # (B, V)
    for step in range(n_new):
        length = T + step
        next_ids = sample_next(logits, params, previous_ids=tokens[:, :length], previous_mask=keep[:, :length],
                               output_ids=tokens[:, T:length], stop_ids=stop_ids, generator=generator)  # (B,)
        if len(stops):  # a stopped row repeats its stop token; no host read here
            next_ids = torch.where(finished, tokens[:, length - 1], next_ids)
            finished |= torch.isin(next_ids, stops)
        tokens[:, length] = next_ids
        if options.stream is not None:
            options.stream(next_ids)
        if step == n_new - 1:
            break
        all_stopped = finished.all() if len(stops) else None  # (), still on the device
        logits = decoder.step(next_ids)  # (B, V)
        # The stop test, one step late: read whether every row had stopped only after the next forward
        # pass is queued, so the device never idles waiting for the host. If they had, that forward's
        # logits are dropped unsampled: the tokens are the same as testing before it.
        if all_stopped is not None and bool(all_stopped):
            break
    new_ids = tokens[:, T:]
    if step < n_new - 1:  # stopped early: rows repeat their last (stop) token in the slots never generated
        new_ids[:, step + 1:] = new_ids[:, step:step + 1]
    return new_ids.clone()


def generate_long(
    model: TransformerLM,
    idx: torch.Tensor,
    params: SamplingParams | int,
    *,
    keep_tokens: int | None = None,
    eos_token_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    stream: Callable[[torch.Tensor], None] | None = None,
    compile: bool = False,
    draft_model: TransformerLM | str | None = None,
    num_speculative_tokens: int = 4,
    **sampling,
) -> torch.Tensor:
    """Continue one unpadded batch past the model's context length. Returns the new ids (B, <= max_tokens).

    Generation runs in chunks: fill the context with `generate` (KV cache), then keep only the last
    `keep_tokens` tokens (default: half the context), prefill them into a fresh cache, and go on.
    Each token therefore sees between keep_tokens and max_seq_len tokens of history. `params`,
    `sampling` and the decode options (compile, draft_model, num_speculative_tokens) are generate's.
    """
    if "attention_mask" in sampling:
        raise ValueError("generate_long takes unpadded prompts only (no attention_mask); generate one row at a time")
    params = as_sampling_params(params, sampling)
    context = model.config.max_seq_len
    keep_tokens = context // 2 if keep_tokens is None else keep_tokens
    integer("keep_tokens", keep_tokens, low=1, high=context - 1, expected=f"an integer in [1, max_seq_len={context})")
    if generator is None:  # one generator for every chunk, so a seed does not repeat its draws
        generator = params.make_generator(idx.device)
    options = DecodeOptions(eos_token_id=eos_token_id, use_cache=use_cache, generator=generator, stream=stream,
                            compile=compile, draft_model=draft_model, num_speculative_tokens=num_speculative_tokens)
    stops = torch.tensor(params.stops(eos_token_id), dtype=torch.long, device=idx.device)  # (S,)
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)  # (B,) rows that have stopped
    window = idx[:, -context + 1:] if idx.shape[1] >= context else idx  # at least one slot left to generate
    chunks: list[torch.Tensor] = []
    produced = 0
    while produced < params.max_tokens:
        n = min(params.max_tokens - produced, context - window.shape[1])
        chunk_params = dataclasses.replace(params, max_tokens=n, seed=None)
        if not chunks:  # the first chunk goes through the door; the rest are our own ids
            _check_generate_args(model, window, chunk_params, options)
        new = decode(model, window, chunk_params, options)  # (B, n)
        if len(stops):  # a row that stopped in an earlier chunk keeps repeating its stop token
            if chunks:
                new = torch.where(finished[:, None], chunks[-1][:, -1:], new)
            finished |= torch.isin(new, stops).any(dim=-1)
        chunks.append(new)
        produced += n
        if len(stops) and bool(finished.all()):
            break  # every row has stopped
        window = torch.cat([window, new], dim=1)[:, -keep_tokens:]  # (B, keep_tokens)
    return torch.cat(chunks, dim=1)
