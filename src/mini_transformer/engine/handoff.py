"""Handing a prefilled request from one engine to another (prefill/decode disaggregation).

    handoff = prefill_engine.prefill_for_handoff(prompt_ids, params)   # runs the prompt, lets go of it
    ... move handoff.kv, handoff.first_token, handoff.generator_state to the other side ...
    request_id = decode_engine.adopt_prefilled(handoff, params)        # joins the running batch there

Only the CONTENTS of the blocks travel: the two engines' block tables differ. The decode side gives the
request blocks of its own pool, writes the prompt's K/V into their slots, counts the prompt as computed
and appends the first token; from then on its steps decode the request as if it had prefilled it. The
random generator's state travels too, so a seeded sampled request continues the same stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import token_id
from ..inference.sampling import SamplingParams
from .block_manager import blocks_for
from .sequence import Sequence


@dataclass(frozen=True)
class KVHandoff:
    """A request prefilled by one engine, as another engine needs it to go on decoding.

    kv (2, n_layer, P, Hkv, D): the K/V of the P prompt tokens, k then v, in token order; None when the
    first token already finished the request (a stop token, or max_tokens=1): nothing is left to decode.
    generator_state: the request's random generator after the first token (None: greedy or unseeded).
    """

    prompt_token_ids: tuple[int, ...]
    first_token: int
    finished: bool
    finish_reason: str | None
    generator_state: torch.Tensor | None
    kv: torch.Tensor | None

    @property
    def kv_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


def prefill(engine, prompt_token_ids, params: SamplingParams) -> KVHandoff:
    """LLMEngine.prefill_for_handoff's work, on the engine's thread. However it ends, the
    request leaves the engine (so the next handoff finds it empty): handed off, finished at its first
    token, or aborted when a step or the K/V copy raised. A handoff counts as one, not as an abort."""
    if engine.requests:
        raise RuntimeError(f"prefill_for_handoff needs an engine with no other requests in flight (it has "
                           f"{len(engine.requests)}): their outputs of the steps it runs would be lost")
    request_id = engine.add_request(prompt_token_ids, params)
    seq: Sequence = engine.requests[request_id]
    try:
        first = None
        while first is None:  # a long prompt may take several steps (chunked prefill)
            first = next((out for out in engine.step() if out.request_id == request_id), None)
        state = None if seq.generator is None else seq.generator.get_state()
        # a finished request has freed its blocks already: nothing to read
        kv = None if first.finished else engine.runner.copy_kv_out(seq.block_table, seq.num_prompt_tokens)
    except BaseException:
        engine.abort(request_id)  # still holding its blocks unless the failed step ended it already
        raise
    if not first.finished:
        engine._forget(seq)
        engine.scheduler.finish(seq)  # its blocks return to the pool; its prefix stays in the cache
        engine.counters["requests_handed_off"] += 1
    return KVHandoff(tuple(seq.prompt_token_ids), first.new_token_ids[0], first.finished, first.finish_reason,
                     state, kv)


def check_handoff(engine, handoff: KVHandoff, params: SamplingParams) -> tuple[list[int], tuple[int, ...]]:
    """adopt_prefilled's door checks (add_request's, then the handoff's own): the prompt as a list and
    the ids that stop it, or an error naming the field of `kv_handoff` that does not fit this engine."""
    if not isinstance(handoff, KVHandoff):
        raise TypeError(f"kv_handoff must be a KVHandoff, got {type(handoff).__name__}")
    prompt, stops = engine.check_request(handoff.prompt_token_ids, params)
    if params.logprobs is not None or params.prompt_logprobs is not None:
        raise ValueError("logprobs / prompt_logprobs: a KVHandoff does not carry the prefill engine's "
                         "logprobs, so the decoding engine cannot return them complete")
    if handoff.finished:
        raise ValueError("kv_handoff.finished is True: the request ended at its first token, nothing to decode")
    cfg, runner, kv = engine.config, engine.runner, handoff.kv
    shape = (2, cfg.n_layer, len(prompt), cfg.n_kv_heads, cfg.d_head)
    if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != shape or kv.dtype != runner.dtype:
        got = f"shape {tuple(kv.shape)} and dtype {kv.dtype}" if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"kv_handoff.kv is {got}; this engine expects a tensor of shape {shape} and dtype "
                         f"{runner.dtype}")
    first = handoff.first_token
    token_id("kv_handoff.first_token", first, cfg.vocab_size)
    if first in stops or params.max_tokens == 1:
        raise ValueError(f"kv_handoff.first_token={first} already ends the request (a stop token, or "
                         "max_tokens=1)")
    _check_generator_state(handoff.generator_state, params, runner.device)
    if params.structured is not None and not engine.structured_output.matcher(params.structured).accept_token(first):
        raise ValueError(f"kv_handoff.first_token={first} does not fit params.structured ({params.structured.kind})")
    if blocks_for(len(prompt), engine.block_size) > engine.block_manager.num_free_blocks:
        raise RuntimeError(f"the engine has no room for a {len(prompt)}-token prompt now; give it more blocks")
    return prompt, stops


def _check_generator_state(state, params: SamplingParams, device: torch.device) -> None:
    """The state must fit the generator this engine makes for `params` (a CPU and a CUDA generator keep
    states of different sizes), so that setting it cannot fail once the request holds blocks."""
    if (state is None) != (params.seed is None):
        raise ValueError("kv_handoff.generator_state must be given exactly when params has a seed")
    if state is None:
        return
    expected = params.make_generator(device).get_state()
    if not isinstance(state, torch.Tensor) or state.dtype != expected.dtype or state.shape != expected.shape:
        got = f"{state.dtype} {tuple(state.shape)}" if isinstance(state, torch.Tensor) else type(state).__name__
        raise ValueError(f"kv_handoff.generator_state is {got}; a generator on {device} keeps a "
                         f"{expected.dtype} {tuple(expected.shape)} state")


def adopt(engine, seq: Sequence, handoff: KVHandoff) -> None:
    """Give a new sequence (already in engine.requests) blocks of this pool holding the handed-off
    prompt K/V, and its first token, and put it in the running batch; check_handoff has seen the room.
    Should anything fail on the way (the copy to the device runs out of memory, the generator refuses
    its state), the request leaves no trace: not in engine.requests, no block held, and nothing in the
    prefix cache (its full blocks were registered there before their K/V arrived)."""
    manager = engine.block_manager
    try:
        manager.admit(seq, [])
        allocated = manager.allocate_slots(seq, seq.num_prompt_tokens)
        assert allocated, "check_handoff saw the room"
        engine.runner.copy_kv_in(seq.block_table, handoff.kv)
        if seq.generator is not None:
            seq.generator.set_state(handoff.generator_state)
    except BaseException:
        manager.forget_uncomputed(seq)  # nothing counts as computed yet: every block leaves the cache
        manager.free(seq)
        engine._forget(seq)
        raise
    seq.num_computed_tokens = seq.num_prompt_tokens
    seq.append_token(handoff.first_token)
    engine.scheduler.add_running(seq)
