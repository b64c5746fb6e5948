"""Autoregressive generation: prefill the prompt once, then decode one token at a time from the KV cache.

    new_ids = generate(model, idx, SamplingParams(max_tokens=50, temperature=0.8, top_k=40), attention_mask=mask)
    new_ids = generate(model, idx, 50, temperature=0.8, top_k=40)      # the same call, keywords form

Prompts of different lengths share a batch by LEFT padding (`attention_mask` 0 = padding): every row's
last prompt token then sits in the last column, so one decode step serves all rows. The model gives a
left-padded row positions 0, 1, ... from its first real token, so padding never changes its tokens.

`use_cache=False` is the naive loop: every step runs the whole sequence again, O(T^2) work per token
instead of O(T). It exists to check the cache and to measure what it buys.

This is one static batch (the learner's version); `engine/` serves many requests that come and go.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .._checks import boolean, instance, integer, positive_int, token_id, token_ids
from ..model.transformer import TransformerLM, check_attention_mask, check_token_ids
from .kv_cache import KVCache
from .sampling import SamplingParams, sample_next


def prefill(model: TransformerLM, idx: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None):
    """Run the whole prompt (B, T) once, filling the cache. Returns the last position's logits (B, V)."""
    last = torch.tensor([-1], device=idx.device)
    logits, _ = model(idx, attention_mask=attention_mask, cache=cache, logits_at=last, check=False)  # (B, 1, V)
    return logits[:, -1]


def decode_step(model: TransformerLM, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run one new token per row (B,) against the cached keys/values. Returns its logits (B, V)."""
    logits, _ = model(token[:, None], cache=cache, check=False)  # (B, 1, V)
    return logits[:, -1]


class GraphStep:
    """The compiled decode step of ONE (model, cache), called without dynamo from the second step on.

    Each call of a dynamo-compiled function walks the model to gather its ~180 weight and cache tensors,
    looks its graph up and (even with skip_guard_eval_unsafe) checks the tensors for aliasing: ~0.4 ms of
    CPU per step on a 12-layer model (9% of an int8 step, measured; docs/08). Inside one generate() call
    the inputs are the same tensors every step except the token. So the first step goes through dynamo
    (every guard checked) while the CPU backend records the flat inputs it passes the graph; later steps
    call the graph with that list, the new token in its slot. Where nothing usable was recorded (cuda's
    CUDA graphs, a graph that does not take the token as one input), it keeps dynamo, skipping guards."""

    def __init__(self, step: Callable, model: TransformerLM, token: torch.Tensor, cache):
        from .cpu_decode import RECORDING

        self.step, self.graph = step, None
        RECORDING.calls = []
        try:
            self.first_logits = step(model, token, cache)  # (B, V), through dynamo with its guards
            calls = RECORDING.calls
        finally:
            RECORDING.calls = None
        if len(calls) != 1:
            return
        graph, inputs, outputs = calls[0]
        token_at = [i for i, t in enumerate(inputs) if t is token]
        logits_at = [i for i, t in enumerate(outputs) if t is self.first_logits]
        if len(token_at) == 1 and len(logits_at) == 1:
            self.graph, self.inputs, self.token_at, self.logits_at = graph, list(inputs), token_at[0], logits_at[0]

    def __call__(self, model: TransformerLM, token: torch.Tensor, cache) -> torch.Tensor:
        if self.graph is None:
            from .static_cache import step_without_guards

            return step_without_guards(self.step, model, token, cache)
        self.inputs[self.token_at] = token  # (B,) int64 like the first: sample_next's argmax
        return self.graph(*self.inputs)[self.logits_at]


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


def _check_generate_args(model, idx, params, attention_mask, eos_token_id, stream) -> None:
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
    _check_generate_args(model, idx, params, attention_mask, eos_token_id, stream)
    boolean("compile", compile)
    if compile and not use_cache:
        raise ValueError("compile=True decodes from a static KV cache; it cannot be combined with use_cache=False")
    if draft_model is not None and (compile or not use_cache or attention_mask is not None):
        raise ValueError("draft_model: speculative decoding runs one unpadded row from the KV cache "
                         "(no compile, no use_cache=False, no attention_mask)")
    return _generate(model, idx, params, attention_mask=attention_mask, eos_token_id=eos_token_id,
                     use_cache=use_cache, generator=generator, stream=stream, compile=compile,
                     draft_model=draft_model, num_speculative_tokens=num_speculative_tokens)


@torch.inference_mode()
def _generate(model, idx, params: SamplingParams, *, attention_mask, eos_token_id, use_cache, generator, stream,
              compile, draft_model, num_speculative_tokens) -> torch.Tensor:
    """generate's work, on arguments its door has checked (generate_long's later chunks come here too)."""
    if draft_model is not None:
        from .speculative import speculative_generate

        return speculative_generate(model, idx, params, draft_model, num_speculative_tokens,
                                    eos_token_id=eos_token_id, generator=generator, stream=stream)
    if generator is None:
        generator = params.make_generator(idx.device)
    B, T = idx.shape
    n_new = params.max_tokens
    device = idx.device
    # Every token so far (prompt + new) and which of them are real: the no-cache path re-runs them,
    # the repetition penalty looks at them.
    tokens = torch.empty(B, T + n_new, dtype=torch.long, device=device)
    tokens[:, :T] = idx
    keep = torch.ones(B, T + n_new, dtype=torch.bool, device=device)
    if attention_mask is not None:
        keep[:, :T] = attention_mask.bool()
    prompt_mask = attention_mask if attention_mask is not None and not bool(keep[:, :T].all()) else None
    stop_ids = params.stops(eos_token_id)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)  # (S,)
    finished = torch.zeros(B, dtype=torch.bool, device=device)

    was_training = model.training
    model.eval()
    try:
        step_fn = decode_step
        if use_cache:
            dtype = model.tok_emb.weight.dtype
            if compile:  # fixed shapes: every decode step runs the same compiled graph
                from .static_cache import compiled_decode_step, decode_cache, static_length

                max_len = static_length(T + n_new, model.config.max_seq_len)
                cache = decode_cache(model, B, max_len, dtype=dtype, device=device)
                step_fn = compiled_decode_step(device)
            else:
                cache = KVCache.for_model(model, B, T + n_new, dtype=dtype, device=device)
            logits = prefill(model, idx, cache, prompt_mask)
        else:
            logits = model(idx, attention_mask=prompt_mask, check=False)[0][:, -1]
        for step in range(n_new):
            length = T + step
            next_ids = sample_next(logits, params, previous_ids=tokens[:, :length], previous_mask=keep[:, :length],
                                   output_ids=tokens[:, T:length], stop_ids=stop_ids, generator=generator)  # (B,)
            if len(stops):  # a stopped row repeats its stop token; no host read here
                next_ids = torch.where(finished, tokens[:, length - 1], next_ids)
                finished |= torch.isin(next_ids, stops)
            tokens[:, length] = next_ids
            if stream is not None:
                stream(next_ids)
            if step == n_new - 1:
                break
            all_stopped = finished.all() if len(stops) else None  # (), still on the device
            if use_cache and compile and step == 0:
                graph_step = GraphStep(step_fn, model, next_ids, cache)
                logits = graph_step.first_logits
            elif use_cache and compile:
                logits = graph_step(model, next_ids, cache)
            elif use_cache:
                logits = step_fn(model, next_ids, cache)
            else:  # the naive way: the whole sequence again, to read one new row of logits
                mask = keep[:, :length + 1] if prompt_mask is not None else None
                logits = model(tokens[:, :length + 1], attention_mask=mask, check=False)[0][:, -1]
            # The stop test, one step late: read whether every row had stopped only after the next forward
            # pass is queued, so the device never idles waiting for the host. If they had, that forward's
            # logits are dropped unsampled: the tokens are the same as testing before it.
            if all_stopped is not None and bool(all_stopped):
                break
    finally:
        model.train(was_training)
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
    stops = torch.tensor(params.stops(eos_token_id), dtype=torch.long, device=idx.device)  # (S,)
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)  # (B,) rows that have stopped
    window = idx[:, -context + 1:] if idx.shape[1] >= context else idx  # at least one slot left to generate
    chunks: list[torch.Tensor] = []
    produced = 0
    while produced < params.max_tokens:
        n = min(params.max_tokens - produced, context - window.shape[1])
        chunk_params = dataclasses.replace(params, max_tokens=n, seed=None)
        run = _generate if chunks else generate  # the first chunk goes through the door; the rest are our own ids
        new = run(model, window, chunk_params, attention_mask=None, eos_token_id=eos_token_id, use_cache=use_cache,
                  generator=generator, stream=stream, compile=compile, draft_model=draft_model,
                  num_speculative_tokens=num_speculative_tokens)  # (B, n)
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
