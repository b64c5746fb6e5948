"""LLMEngine: the public face of the serving engine. One step = schedule -> run the model -> update.

    engine = LLMEngine(model, block_size=16, max_num_seqs=64, max_num_batched_tokens=512)
    request_id = engine.add_request(prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished_requests():
        for out in engine.step():          # RequestOutput(request_id, new_token_ids, finished, finish_reason)
            ...
    completions = engine.generate(list_of_prompt_id_lists, params)   # the same loop, with a progress bar
    view = engine.snapshot()               # frozen: queues, block tables, the pool, stats (for a server)
    handoff = engine.prefill_for_handoff(ids, params); other_engine.adopt_prefilled(handoff, params)  # PD

Requests can be added and aborted between any two steps (continuous batching). Every public method
takes one lock, so a server may call add_request / abort from one thread while another thread steps.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence as Seq

import torch
from tqdm import tqdm

from ..inference.sampling import SamplingParams
from ..model.transformer import TransformerLM
from . import handoff
from .block_manager import BlockManager, blocks_for
from .handoff import KVHandoff
from .kv_connector import KVConnector
from .model_runner import ModelRunner, bytes_per_block
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence
from .snapshot import EngineSnapshot
from .structured import GrammarError, StructuredOutputManager


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def default_kv_cache_bytes(device: torch.device) -> int:
    """A sensible share of memory for the pool: half the free GPU memory, or an eighth of the host's RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8


class InvalidRequest(ValueError):
    """A request the engine refuses at add_request; `argument` names the one at fault ("prompt_token_ids",
    "max_tokens" when it cannot fit the context or the pool, "stop_token_ids")."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


class LLMEngine:
    def __init__(
        self,
        model: TransformerLM,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = True,
        *,
        eos_token_id: int | None = None,
        kv_connector: KVConnector | None = None,
        tokenizer=None,
    ):
        """`num_blocks` KV blocks of `block_size` tokens; or as many as fit in `kv_cache_bytes`; or, with
        neither, a share of memory (capped at what max_num_seqs full-length sequences could use).
        `eos_token_id` ends a request unless its SamplingParams say ignore_eos. The model is put in eval
        mode (the engine only runs inference) and is used as it is: its device and dtype are the pool's.
        `kv_connector` (engine/kv_connector.py) keeps full blocks in tiers behind the pool (host memory,
        Redis) and loads them back for any engine serving the same weights.
        `tokenizer` (a CharTokenizer or byte-level BPETokenizer) is needed only by requests with
        SamplingParams.structured: the grammar's token masks are built from its vocabulary."""
        if not isinstance(model, TransformerLM):
            raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
        cfg = model.config
        _positive_int("block_size", block_size)
        if cfg.attn_backend == "triton" and block_size & (block_size - 1):
            raise ValueError(f"block_size={block_size}: the triton backend's paged kernel needs a power of two")
        _positive_int("max_num_seqs", max_num_seqs)
        _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching={enable_prefix_caching!r} must be a bool")
        if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)
                                         or not 0 <= eos_token_id < cfg.vocab_size):
            raise ValueError(f"eos_token_id={eos_token_id!r} must be None or a token id in [0, {cfg.vocab_size})")
        weight = model.tok_emb.weight
        block_bytes = bytes_per_block(cfg, block_size, weight.dtype)
        if num_blocks is not None and kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        if num_blocks is None:
            if kv_cache_bytes is None:
                cap = max_num_seqs * blocks_for(cfg.max_seq_len, block_size)
                num_blocks = max(1, min(cap, default_kv_cache_bytes(weight.device) // block_bytes))
            else:
                _positive_int("kv_cache_bytes", kv_cache_bytes)
                num_blocks = kv_cache_bytes // block_bytes
                if num_blocks < 1:
                    raise ValueError(f"kv_cache_bytes={kv_cache_bytes} is smaller than one block "
                                     f"({block_bytes} bytes at block_size={block_size})")
        _positive_int("num_blocks", num_blocks)
        if kv_connector is not None and not isinstance(kv_connector, KVConnector):
            raise TypeError(f"kv_connector must be a KVConnector, got {type(kv_connector).__name__}")

        self.model = model.eval()
        self.config = cfg
        self.block_size, self.num_blocks = block_size, num_blocks
        self.eos_token_id = eos_token_id
        self.tokenizer = tokenizer
        self._structured: StructuredOutputManager | None = None  # built at the first constrained request
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.bind(model, self.runner.kv_cache, block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, kv_connector)
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._lock = threading.RLock()
        self.counters = dict(steps=0, prefill_tokens_computed=0, decode_tokens_computed=0,
                             prefix_cache_hit_tokens=0, preemptions=0, requests_finished=0,
                             requests_aborted=0, requests_handed_off=0, max_batched_tokens_seen=0,
                             mixed_steps=0, kv_store_hit_tokens=0)

    # ----------------------------------------------------------------------------------- requests
    def add_request(self, prompt_token_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt (a list of token ids, or a 1-D integer tensor). Returns its request id.
        A request that could never run raises ValueError (an InvalidRequest) here, and nothing else is
        disturbed."""
        params = SamplingParams() if params is None else params
        prompt, stops = self.check_request(prompt_token_ids, params)
        with self._lock:
            seq = self._new_sequence(prompt, params, stops, request_id)
            self.scheduler.add(seq)
        return seq.request_id

    def _new_sequence(self, prompt: list[int], params: SamplingParams, stops, request_id: str | None) -> Sequence:
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.requests:
                request_id = str(next(self._ids))
        elif not isinstance(request_id, str) or request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} must be a string not used by an unfinished request")
        seq = Sequence(request_id, prompt, params, stops, arrival=next(self._arrivals), device=self.runner.device)
        if params.structured is not None:
            seq.grammar = self.structured_output.matcher(params.structured)
        self.requests[request_id] = seq
        return seq

    def check_request(self, prompt_token_ids, params: SamplingParams) -> tuple[list[int], tuple[int, ...]]:
        """add_request's door checks, on their own: the prompt as a list and the ids that stop it, or
        InvalidRequest naming the argument at fault. It reads only what __init__ fixed, so a server's
        HTTP thread may call it to refuse a request before it reaches the engine thread."""
        cfg = self.config
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt = self._prompt_list(prompt_token_ids)
        total = len(prompt) + params.max_tokens
        if total > cfg.max_seq_len:
            raise InvalidRequest("max_tokens", f"prompt length {len(prompt)} + max_tokens {params.max_tokens} = "
                                               f"{total} exceeds the model's max_seq_len={cfg.max_seq_len}")
        needed = blocks_for(total - 1, self.block_size)  # the last token is sampled, never written to the cache
        if needed > self.num_blocks:
            raise InvalidRequest("max_tokens", f"this request needs up to {needed} KV blocks of {self.block_size} "
                                               f"tokens but the pool has only num_blocks={self.num_blocks}; "
                                               "shorten it or give the engine more blocks")
        stops = params.stops(self.eos_token_id)
        if any(t >= cfg.vocab_size for t in stops):
            raise InvalidRequest("stop_token_ids", f"stop_token_ids={params.stop_token_ids} must be token ids in "
                                                   f"[0, {cfg.vocab_size})")
        if params.logit_bias and params.logit_bias[-1][0] >= cfg.vocab_size:  # sorted by token id
            raise InvalidRequest("logit_bias", f"logit_bias names token {params.logit_bias[-1][0]}; token ids are "
                                               f"in [0, {cfg.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > cfg.vocab_size:
                raise InvalidRequest(name, f"{name}={getattr(params, name)} exceeds the vocabulary ({cfg.vocab_size})")
        if params.structured is not None:
            try:
                self.structured_output.compile(params.structured)  # cached: add_request's matcher reuses it
            except GrammarError as err:
                raise InvalidRequest(err.argument, str(err)) from None
        return prompt, stops

    @property
    def structured_output(self) -> StructuredOutputManager:
        """The grammar compiler over this engine's vocabulary (xgrammar is imported on first use)."""
        if self._structured is None:
            with self._lock:
                if self.tokenizer is None:
                    raise GrammarError("structured", "structured output needs the engine's tokenizer: "
                                                     "LLMEngine(model, tokenizer=...)")
                if self._structured is None:
                    self._structured = StructuredOutputManager(self.tokenizer, self.config.vocab_size,
                                                               self.eos_token_id)
        return self._structured

    def _prompt_list(self, prompt_token_ids) -> list[int]:
        if isinstance(prompt_token_ids, torch.Tensor):
            if prompt_token_ids.dim() != 1 or prompt_token_ids.is_floating_point():
                shape, dtype = tuple(prompt_token_ids.shape), prompt_token_ids.dtype
                raise InvalidRequest("prompt_token_ids", f"prompt_token_ids must be a 1-D integer tensor, got "
                                                         f"shape {shape} of dtype {dtype}")
            prompt_token_ids = prompt_token_ids.tolist()
        if not isinstance(prompt_token_ids, list | tuple):
            raise TypeError(f"prompt_token_ids must be a list of token ids, got {type(prompt_token_ids).__name__}")
        if not prompt_token_ids:
            raise InvalidRequest("prompt_token_ids",
                                 "prompt_token_ids is empty; a request needs at least one prompt token")
        vocab = self.config.vocab_size
        for token in prompt_token_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise InvalidRequest("prompt_token_ids", f"prompt_token_ids contains {token!r}, expected token ids "
                                                         f"in [0, vocab_size={vocab})")
        return list(prompt_token_ids)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. False if it is unknown or already finished."""
        with self._lock:
            seq = self.requests.pop(request_id, None)
            if seq is None:
                return False
            self.scheduler.finish(seq)
            seq.finish("abort")
            self.counters["requests_aborted"] += 1
            return True

    # ------------------------------------------------------------- prefill/decode disaggregation
    def prefill_for_handoff(self, prompt_token_ids, params: SamplingParams | None = None) -> KVHandoff:
        """Run one request's prompt until its first token is sampled and hand back what another engine
        needs to decode it (see engine/handoff.py); the request then leaves this engine (its blocks
        return to the pool, its prefix stays cached). The engine must have no other requests in flight."""
        with self._lock:
            return handoff.prefill(self, prompt_token_ids, SamplingParams() if params is None else params)

    def kv_buffer(self, num_tokens: int) -> torch.Tensor:
        """An empty (2, n_layer, num_tokens, Hkv, D) CPU tensor of the pool's dtype: where a receiver
        puts the K/V of a handoff before adopt_prefilled."""
        cfg = self.config
        _positive_int("num_tokens", num_tokens)
        return torch.empty(2, cfg.n_layer, num_tokens, cfg.n_kv_heads, cfg.d_head, dtype=self.runner.dtype)

    def adopt_prefilled(self, kv_handoff: KVHandoff, params: SamplingParams | None = None,
                        request_id: str | None = None) -> str:
        """Take over a request another engine prefilled (prefill_for_handoff there, same params): its
        prompt K/V go into blocks of this pool, its first token is appended, and it joins the running
        batch, so the next steps decode it. Returns its request id here; the first token is not
        reported again by step(). max_num_seqs does not hold it back: the caller paces what it hands over."""
        params = SamplingParams() if params is None else params
        with self._lock:
            prompt, stops = handoff.check_handoff(self, kv_handoff, params)
            seq = self._new_sequence(prompt, params, stops, request_id)
            handoff.adopt(self, seq, kv_handoff)
            return seq.request_id

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self.requests)

    # --------------------------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample. Returns one RequestOutput per request that produced a
        token in this step (a request still in the middle of its prefill produces none). If the forward
        pass raises, the requests of this step end with finish_reason "error" and the error propagates."""
        with self._lock:
            plan = self.scheduler.schedule()
            self.counters["preemptions"] += len(plan.preempted)
            self.counters["prefix_cache_hit_tokens"] += plan.prefix_cache_hit_tokens
            self.counters["kv_store_hit_tokens"] += plan.kv_store_hit_tokens
            if not plan.scheduled:
                assert not self.scheduler.has_unfinished(), "the scheduler made no progress"
                return []
            try:
                next_ids = self.runner.execute_model(plan.scheduled)
            except Exception:
                self._fail(plan.scheduled)
                raise
            if self.kv_connector is not None:  # the blocks this pass completed, before _update counts them
                self.kv_connector.save(plan.scheduled)
            self.counters["steps"] += 1
            prefilling = [seq.num_computed_tokens < seq.num_prompt_tokens for seq, _ in plan.scheduled]
            self.counters["mixed_steps"] += any(prefilling) and not all(prefilling)  # prefill beside decode
            self.counters["max_batched_tokens_seen"] = max(self.counters["max_batched_tokens_seen"],
                                                           plan.num_batched_tokens)
            return [out for (seq, n), token in zip(plan.scheduled, next_ids, strict=True)
                    if (out := self._update(seq, n, token)) is not None]

    def _fail(self, scheduled) -> None:
        """The forward pass raised: the requests in it end (finish_reason "error"), their half-written
        blocks leave the prefix cache, and the engine stays usable for the others."""
        for seq, _ in scheduled:
            self.block_manager.forget_uncomputed(seq)
            self.scheduler.finish(seq)
            seq.finish("error")
            self.requests.pop(seq.request_id, None)

    def _update(self, seq: Sequence, num_new: int, token: int | None) -> RequestOutput | None:
        start = seq.num_computed_tokens
        in_prompt = max(0, min(start + num_new, seq.num_prompt_tokens) - start)
        self.counters["prefill_tokens_computed"] += in_prompt
        self.counters["decode_tokens_computed"] += num_new - in_prompt
        seq.num_computed_tokens += num_new
        if token is None:
            return None
        added = seq.append_token(token)
        if seq.is_finished:
            self.scheduler.finish(seq)
            del self.requests[seq.request_id]
            self.counters["requests_finished"] += 1
        logprobs = None if seq.params.logprobs is None else (seq.output_logprobs[-1],)
        prompt_logprobs = None
        if seq.needs_prompt_logprobs:  # complete by now: the first token needed the whole prompt computed
            prompt_logprobs, seq.prompt_logprobs_sent = tuple(seq.prompt_logprobs), True
        new = [token] if added else []  # a token the grammar refused ends the request without it
        return RequestOutput(seq.request_id, new, seq.is_finished, seq.finish_reason, logprobs, prompt_logprobs)

    # ----------------------------------------------------------------------------------- generate
    def generate(self, prompts: Seq, params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[list[int]]:
        """Run a list of prompts (lists of token ids) to completion. Returns their output ids, in prompt
        order. `params` is one SamplingParams for all, or one per prompt. Outputs of other requests
        already in the engine are stepped along but not returned."""
        if not isinstance(prompts, list | tuple):
            raise TypeError(f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__}")
        per_prompt = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, prompt_params in zip(prompts, per_prompt, strict=True):
                ids.append(self.add_request(prompt, prompt_params))
        except (TypeError, ValueError):
            for request_id in ids:  # all or nothing: a bad prompt leaves no half-added batch behind
                self.abort(request_id)
            raise
        outputs: dict[str, list[int]] = {request_id: [] for request_id in ids}
        remaining = set(ids)
        with tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm) as bar:
            while remaining:
                for out in self.step():
                    if out.request_id in outputs:
                        outputs[out.request_id] += out.new_token_ids
                        if out.finished:
                            remaining.discard(out.request_id)
                            bar.update(1)
        return [outputs[request_id] for request_id in ids]

    # -------------------------------------------------------------------------------------- stats
    def stats(self) -> dict:
        """Counters since the engine started, and the pool as it is now."""
        with self._lock:
            manager = self.block_manager
            block_bytes = self.runner.kv_cache.nbytes // self.num_blocks
            return dict(
                **self.counters,
                num_blocks=self.num_blocks,
                block_size=self.block_size,
                blocks_in_use=manager.num_blocks_in_use,
                peak_blocks_in_use=manager.peak_blocks_in_use,
                shared_blocks=manager.num_shared_blocks,
                cached_blocks=len(manager.hash_to_block_id),
                kv_cache_bytes=self.runner.kv_cache.nbytes,
                kv_bytes_in_use=manager.num_blocks_in_use * block_bytes,
                kv_bytes_holding_tokens=self._slots_holding_tokens() * block_bytes // self.block_size,
                num_waiting=len(self.scheduler.waiting),
                num_running=len(self.scheduler.running),
                **({} if self.kv_connector is None
                   else {f"kv_store_{k}": v for k, v in self.kv_connector.stats().items()}),
            )

    def snapshot(self) -> EngineSnapshot:
        """The queues, each request's block table, the pool block by block and stats(), all from one
        moment (taken under the lock), as plain frozen data for a server's metrics and live page."""
        with self._lock:
            tiers = None if self.kv_connector is None else self.kv_connector.block_tiers(self.block_manager.blocks)
            return EngineSnapshot.of(self.scheduler, self.block_manager, self.stats(), tiers)

    def _slots_holding_tokens(self) -> int:
        """Slots of in-use blocks that hold a computed token (a shared block counts once)."""
        filled: dict[int, int] = {}
        for seq in self.scheduler.running:
            for i, block_id in enumerate(seq.block_table):
                fill = min(self.block_size, max(0, seq.num_computed_tokens - i * self.block_size))
                filled[block_id] = max(filled.get(block_id, 0), fill)
        return sum(filled.values())
