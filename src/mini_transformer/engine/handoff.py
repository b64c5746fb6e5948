"""Handing a prefilled request from one engine to another (prefill/decode disaggregation).

    handoff = prefill_engine.prefill_for_handoff(prompt_ids, params)   # runs the prompt, lets go of it
    ... move handoff.kv, handoff.first_token, handoff.generator_state to the other side ...
    request_id = decode_engine.adopt_prefilled(handoff, params)        # joins the running batch there

Only the CONTENTS of the blocks travel: the two engines' block tables differ. The decode side gives the
request blocks of its own pool, writes the prompt's K/V into their slots, counts the prompt as computed
and appends the first token; from then on its steps decode the request as if it had prefilled it. The
random generator's state travels too, so a seeded sampled request continues the same stream.

`KVHandoff` is the data that travels; `PoolHandoff` is the pool's side of it, owned by one LLMEngine
(its two methods above keep the requests and the counters; this file touches blocks and K/V only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import token_id
from ..config import TransformerConfig
from ..inference.sampling import SamplingParams
from .block_manager import BlockManager, blocks_for
from .model_runner import ModelRunner
from .sequence import RequestOutput, Sequence


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


class PoolHandoff:
    """What a handoff does to one engine's pool: read a prefilled request's K/V out of its blocks, and
    check and write a handed-off request's K/V into fresh blocks."""

    def __init__(self, model_config: TransformerConfig, runner: ModelRunner, block_manager: BlockManager):
        self.model_config, self.runner, self.block_manager = model_config, runner, block_manager

    def export(self, seq: Sequence, first: RequestOutput) -> KVHandoff:
        """The handoff of `seq`, whose step just sampled its first token (`first`)."""
        state = None if seq.generator is None else seq.generator.get_state()
        # a finished request has freed its blocks already: nothing to read
        kv = None if first.finished else self.runner.copy_kv_out(seq.block_table, seq.num_prompt_tokens)
        return KVHandoff(tuple(seq.prompt_token_ids), first.new_token_ids[0], first.finished, first.finish_reason,
                         state, kv)

    def check(self, handoff: KVHandoff, prompt: list[int], stops: tuple[int, ...], params: SamplingParams,
              matcher=None) -> None:
        """The handoff's own door checks, after add_request's gave `prompt` and `stops`: an error naming
        the field of `kv_handoff` that does not fit this engine. `matcher`: params.structured's grammar."""
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise ValueError("logprobs / prompt_logprobs: a KVHandoff does not carry the prefill engine's "
                             "logprobs, so the decoding engine cannot return them complete")
        if handoff.finished:
            raise ValueError("kv_handoff.finished is True: the request ended at its first token, nothing to decode")
        cfg, kv, dtype = self.model_config, handoff.kv, self.runner.dtype
        shape = (2, cfg.n_layer, len(prompt), cfg.n_kv_heads, cfg.d_head)
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != shape or kv.dtype != dtype:
            got = f"shape {tuple(kv.shape)} and dtype {kv.dtype}" if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise ValueError(f"kv_handoff.kv is {got}; this engine expects a tensor of shape {shape} and dtype {dtype}")
        first = handoff.first_token
        token_id("kv_handoff.first_token", first, cfg.vocab_size)
        if first in stops or params.max_tokens == 1:
            raise ValueError(f"kv_handoff.first_token={first} already ends the request (a stop token, or "
                             "max_tokens=1)")
        _check_generator_state(handoff.generator_state, params, self.runner.device)
        if matcher is not None and not matcher.accept_token(first):
            raise ValueError(f"kv_handoff.first_token={first} does not fit params.structured "
                             f"({params.structured.kind})")
        if blocks_for(len(prompt), self.block_manager.block_size) > self.block_manager.num_free_blocks:
            raise RuntimeError(f"the engine has no room for a {len(prompt)}-token prompt now; give it more blocks")

    def write_in(self, seq: Sequence, handoff: KVHandoff) -> None:
        """Give a new sequence blocks of this pool holding the handed-off prompt K/V, count the prompt as
        computed and append the first token; check() has seen the room. Should anything fail on the way
        (the copy to the device runs out of memory, the generator refuses its state), the blocks go back
        and nothing stays in the prefix cache (its full blocks were registered there before their K/V
        arrived); the error propagates."""
        manager = self.block_manager
        try:
            manager.admit(seq, [])
            allocated = manager.allocate_slots(seq, seq.num_prompt_tokens)
            assert allocated, "check() saw the room"
            self.runner.copy_kv_in(seq.block_table, handoff.kv)
            if seq.generator is not None:
                seq.generator.set_state(handoff.generator_state)
        except BaseException:
            manager.forget_uncomputed(seq)  # nothing counts as computed yet: every block leaves the cache
            manager.free(seq)
            raise
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.append_token(handoff.first_token)


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
