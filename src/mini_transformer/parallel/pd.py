"""Prefill/decode disaggregation: one process prefills, another decodes, the KV blocks travel between them.

    # on every rank of a 2-rank group (torchrun): rank 0 prefills, rank 1 decodes
    result = run_disaggregated(model, prompts, params, EngineConfig(block_size=16))
    result.completions   # rank 1: the output ids of every prompt, as one LLMEngine would give them
    result.kv_bytes      # both ranks: the KV bytes that moved, per request

Prefill is compute-bound (a whole prompt per weight read) and decode is bandwidth-bound (one token per
weight read), so serving systems put them on different machines. Here each worker owns an LLMEngine:

  rank 0  `engine.prefill_for_handoff` steps its engine until the request's first token is sampled and
          hands back a KVHandoff (the request then leaves that engine: its blocks return to the pool,
          its prefix stays cached); rank 0 sends
          (1) a header: prompt length, first token, whether the request already finished;
          (2) the sequence's random-generator state (so seeded sampling continues the same stream);
          (3) the K/V of every prompt token, gathered from its blocks: (2, n_layer, P, Hkv, D).
  rank 1  receives them and calls `engine.adopt_prefilled`: the request gets blocks in ITS pool (the
          block tables differ between the two engines: only the contents travel), the K/V go into those
          slots, the prompt counts as computed, the first token is appended, and the request joins the
          running batch; its steps then decode.

The transport is torch.distributed point-to-point (`send` / `recv`): the same code moves the blocks
between machines (gloo over TCP, nccl over NVLink / InfiniBand), where shared memory would only work
inside one host. Bytes per request: 2 * n_layer * P * Hkv * D * bytes per element (+ a few header bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..engine import EngineConfig, KVHandoff, LLMEngine
from ..inference.sampling import SamplingParams
from ..model.transformer import TransformerLM

PREFILL_RANK, DECODE_RANK = 0, 1


@dataclass
class DisaggregatedResult:
    completions: list[list[int]] = field(default_factory=list)  # rank 1 only: output ids per prompt
    kv_bytes: list[int] = field(default_factory=list)  # K/V bytes sent (rank 0) or received (rank 1) per request


def kv_bytes_formula(model: TransformerLM, prompt_len: int) -> int:
    """2 (k and v) * n_layer * P * Hkv * D * bytes per element."""
    cfg = model.config
    return 2 * cfg.n_layer * prompt_len * cfg.n_kv_heads * cfg.d_head * model.tok_emb.weight.element_size()


def _prefill_one(engine: LLMEngine, prompt: list[int], params: SamplingParams, dst: int) -> int:
    handoff = engine.prefill_for_handoff(prompt, params)
    state = handoff.generator_state
    state = torch.empty(0, dtype=torch.uint8) if state is None else state
    header = torch.tensor([len(prompt), handoff.first_token, int(handoff.finished), state.numel()], dtype=torch.long)
    dist.send(header, dst)
    if state.numel():
        dist.send(state, dst)
    if handoff.finished:  # nothing left to decode (EOS or max_tokens=1): no K/V to send
        return 0
    dist.send(handoff.kv, dst)
    return handoff.kv_bytes


def _receive_one(engine: LLMEngine, prompt: list[int], params: SamplingParams, src: int) -> tuple[str | None, int, int]:
    """-> (request id, first token, K/V bytes). The request joins rank 1's engine as if it had prefilled
    there; one that ended at its first token does not join (request id None)."""
    header = torch.empty(4, dtype=torch.long)
    dist.recv(header, src)
    prompt_len, first, finished, state_len = header.tolist()
    assert prompt_len == len(prompt), "the two ranks disagree on the prompts"
    state = torch.empty(state_len, dtype=torch.uint8)
    if state_len:
        dist.recv(state, src)
    if finished:
        return None, first, 0
    kv = engine.kv_buffer(prompt_len)  # (2, n_layer, P, Hkv, D)
    dist.recv(kv, src)
    handoff = KVHandoff(prompt_token_ids=tuple(prompt), first_token=first, finished=False, finish_reason=None,
                        generator_state=state if state_len else None, kv=kv)
    return engine.adopt_prefilled(handoff, params), first, handoff.kv_bytes


def run_disaggregated(model: TransformerLM, prompts: list[list[int]], params: SamplingParams,
                      config: EngineConfig | None = None, *, group=None) -> DisaggregatedResult:
    """Serve `prompts` with rank 0 prefilling and rank 1 decoding (call it on both, same arguments); each
    rank's engine is made with `config` (None: EngineConfig's defaults, room for every prompt at once).
    Seeded or greedy sampling gives what one LLMEngine gives; unseeded sampling draws from each
    process's own global generator and cannot match."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max(1, len(prompts))) if config is None else config)
    for prompt in prompts:  # refused on both ranks before any message, or the decode rank would wait forever
        engine.check_request(prompt, params)
    if not dist.is_initialized() or dist.get_world_size(group) != 2:
        raise ValueError("run_disaggregated needs a torch.distributed group of exactly 2 ranks (prefill, decode)")
    rank = dist.get_rank(group)
    result = DisaggregatedResult()
    if rank == PREFILL_RANK:
        result.kv_bytes = [_prefill_one(engine, list(p), params, DECODE_RANK) for p in prompts]
        return result
    completions: list[list[int]] = []
    by_request: dict[str, list[int]] = {}  # the completions of the requests that joined rank 1's engine
    for prompt in prompts:
        request_id, first, nbytes = _receive_one(engine, list(prompt), params, PREFILL_RANK)
        completions.append([first])
        if request_id is not None:
            by_request[request_id] = completions[-1]
        result.kv_bytes.append(nbytes)
    while engine.has_unfinished_requests():
        for out in engine.step():
            by_request[out.request_id] += out.new_token_ids
    result.completions = completions
    return result
