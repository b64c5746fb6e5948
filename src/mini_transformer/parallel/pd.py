"""Prefill/decode disaggregation: one process prefills, another decodes, the KV blocks travel between them.

    # on every rank of a 2-rank group (torchrun): rank 0 prefills, rank 1 decodes
    result = run_disaggregated(model, prompts, params, block_size=16)
    result.completions   # rank 1: the output ids of every prompt, as one LLMEngine would give them
    result.kv_bytes      # both ranks: the KV bytes that moved, per request

Prefill is compute-bound (a whole prompt per weight read) and decode is bandwidth-bound (one token per
weight read), so serving systems put them on different machines. Here each worker owns an LLMEngine:

  rank 0  add the request, step its engine until the request's first token is sampled, then send
          (1) a header: prompt length, first token, whether the request already finished;
          (2) the sequence's random-generator state (so seeded sampling continues the same stream);
          (3) the K/V of every prompt token, gathered from its blocks: (2, n_layer, P, Hkv, D);
          and abort the request there (its blocks return to the pool, its prefix stays cached).
  rank 1  receive them, give the request blocks in ITS pool (the block tables differ between the two
          engines: only the contents travel), write the K/V into those slots, mark the prompt computed,
          append the first token, and put the request in the running queue; its steps then decode.

The transport is torch.distributed point-to-point (`send` / `recv`): the same code moves the blocks
between machines (gloo over TCP, nccl over NVLink / InfiniBand), where shared memory would only work
inside one host. Bytes per request: 2 * n_layer * P * Hkv * D * bytes per element (+ a few header bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..engine import LLMEngine
from ..engine.sequence import SequenceStatus
from ..sampling import SamplingParams
from ..transformer import TransformerLM

PREFILL_RANK, DECODE_RANK = 0, 1


@dataclass
class DisaggregatedResult:
    completions: list[list[int]] = field(default_factory=list)  # rank 1 only: output ids per prompt
    kv_bytes: list[int] = field(default_factory=list)  # K/V bytes sent (rank 0) or received (rank 1) per request


def kv_bytes_formula(model: TransformerLM, prompt_len: int) -> int:
    """2 (k and v) * n_layer * P * Hkv * D * bytes per element."""
    cfg = model.config
    return 2 * cfg.n_layer * prompt_len * cfg.n_kv_heads * cfg.d_head * model.tok_emb.weight.element_size()


def _slots(block_table: list[int], n_tokens: int, block_size: int) -> torch.Tensor:
    """The pool slots holding tokens 0 .. n_tokens-1: slot = block_id * block_size + offset."""
    return torch.tensor([block_table[i // block_size] * block_size + i % block_size for i in range(n_tokens)])


def _prefill_one(engine: LLMEngine, prompt: list[int], params: SamplingParams, dst: int) -> int:
    request_id = engine.add_request(prompt, params)
    seq = engine.requests[request_id]
    first = None
    while first is None:  # a long prompt may take several steps (chunked prefill)
        first = next((out for out in engine.step() if out.request_id == request_id), None)
    finished = int(first.finished)
    state = seq.generator.get_state() if seq.generator is not None else torch.empty(0, dtype=torch.uint8)
    header = torch.tensor([len(prompt), first.new_token_ids[0], finished, state.numel()], dtype=torch.long)
    dist.send(header, dst)
    if state.numel():
        dist.send(state, dst)
    if finished:  # nothing left to decode (EOS or max_tokens=1): its blocks are already freed
        return 0
    slots = _slots(seq.block_table, len(prompt), engine.block_size).to(engine.runner.device)
    kv = engine.runner.kv_cache[:, :, slots].contiguous()  # (2, n_layer, P, Hkv, D)
    dist.send(kv, dst)
    engine.abort(request_id)
    return kv.numel() * kv.element_size()


def _receive_one(engine: LLMEngine, prompt: list[int], params: SamplingParams, src: int) -> tuple[str, int, int]:
    """-> (request id, first token, K/V bytes). The request joins rank 1's engine as if it had prefilled there."""
    header = torch.empty(4, dtype=torch.long)
    dist.recv(header, src)
    prompt_len, first, finished, state_len = header.tolist()
    assert prompt_len == len(prompt), "the two ranks disagree on the prompts"
    state = torch.empty(state_len, dtype=torch.uint8)
    if state_len:
        dist.recv(state, src)
    request_id = engine.add_request(prompt, params)
    if finished:
        engine.abort(request_id)
        return request_id, first, 0
    seq = engine.requests[request_id]
    cfg, runner, manager = engine.config, engine.runner, engine.block_manager
    kv = torch.empty(2, cfg.n_layer, prompt_len, cfg.n_kv_heads, cfg.d_head, dtype=runner.dtype)
    dist.recv(kv, src)
    engine.scheduler.waiting.remove(seq)  # it skips the queue: its prompt is computed already
    manager.admit(seq, [])
    if not manager.allocate_slots(seq, prompt_len):
        raise RuntimeError(f"the decode engine has no room for a {prompt_len}-token prompt; give it more blocks")
    runner.kv_cache[:, :, _slots(seq.block_table, prompt_len, engine.block_size).to(runner.device)] = kv.to(
        runner.device)
    seq.num_computed_tokens = prompt_len
    if seq.generator is not None:
        seq.generator.set_state(state)
    seq.append_token(first)
    seq.status = SequenceStatus.RUNNING
    engine.scheduler.running.append(seq)
    return request_id, first, kv.numel() * kv.element_size()


def run_disaggregated(model: TransformerLM, prompts: list[list[int]], params: SamplingParams, *,
                      block_size: int = 16, num_blocks: int | None = None, group=None) -> DisaggregatedResult:
    """Serve `prompts` with rank 0 prefilling and rank 1 decoding (call it on both, same arguments).
    Seeded or greedy sampling gives what one LLMEngine gives; unseeded sampling draws from each
    process's own global generator and cannot match."""
    if not dist.is_initialized() or dist.get_world_size(group) != 2:
        raise ValueError("run_disaggregated needs a torch.distributed group of exactly 2 ranks (prefill, decode)")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    rank = dist.get_rank(group)
    engine = LLMEngine(model, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max(1, len(prompts)))
    result = DisaggregatedResult()
    if rank == PREFILL_RANK:
        result.kv_bytes = [_prefill_one(engine, list(p), params, DECODE_RANK) for p in prompts]
        return result
    outputs: dict[str, list[int]] = {}
    order = []
    for prompt in prompts:
        request_id, first, nbytes = _receive_one(engine, list(prompt), params, PREFILL_RANK)
        outputs[request_id], order = [first], [*order, request_id]
        result.kv_bytes.append(nbytes)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    result.completions = [outputs[request_id] for request_id in order]
    return result
