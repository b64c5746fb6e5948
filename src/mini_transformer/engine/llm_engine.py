"""LLMEngine: the public face of the serving engine. One step = schedule -> run the model -> update.

    engine = LLMEngine(model, EngineConfig(block_size=16, max_num_seqs=64, max_num_batched_tokens=512))
    request_id = engine.add_request(prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished_requests():
        for out in engine.step():          # RequestOutput(request_id, new_token_ids, finished, finish_reason)
            ...
    completions = engine.generate(list_of_prompt_id_lists, params)   # the same loop, with a progress bar
    view = engine.snapshot()               # frozen: queues, block tables, the pool, stats (for a server)
    handoff = engine.prefill_for_handoff(ids, params); other_engine.adopt_prefilled(handoff, params)  # PD

Requests can be added and aborted between any two steps (continuous batching). The threading rule: the
engine is NOT thread-safe and takes no lock; one thread owns it (the server's engine loop thread makes
every call). Only `check_request`, which reads what __init__ fixed, may be called from other threads.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence as Seq

import torch
from tqdm import tqdm

from .._checks import instance, positive_int, power_of_two, token_id, token_ids
from ..inference.sampling import SamplingParams
from ..model.transformer import TransformerLM
from .block_manager import BlockManager, blocks_for
from .config import EngineConfig
from .handoff import KVHandoff, PoolHandoff
from .kv_connector import KVConnector
from .model_runner import ModelRunner, bytes_per_block
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence
from .snapshot import EngineSnapshot, EngineStats
from .structured import GrammarError, StructuredOutputManager


class InvalidRequest(ValueError):
    """A request the engine refuses at add_request; `argument` names the one at fault ("prompt_token_ids",
    "max_tokens" when it cannot fit the context or the pool, "stop_token_ids")."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


class LLMEngine:
    def __init__(self, model: TransformerLM, config: EngineConfig | None = None, *,
                 eos_token_id: int | None = None, kv_connector: KVConnector | None = None, tokenizer=None):
        """`config` (an EngineConfig; None: its defaults) sizes the pool and the batch: `num_blocks` KV
        blocks of `block_size` tokens, or as many as fit in `kv_cache_bytes`, or a share of memory.
        `eos_token_id` ends a request unless its SamplingParams say ignore_eos. The model is put in eval
        mode (the engine only runs inference) and is used as it is: its device and dtype are the pool's.
        `kv_connector` (engine/kv_connector.py) keeps full blocks in tiers behind the pool (host memory,
        Redis) and loads them back for any engine serving the same weights.
        `tokenizer` (a CharTokenizer or byte-level BPETokenizer) is needed only by requests with
        SamplingParams.structured: the grammar's token masks are built from its vocabulary."""
        instance("model", model, TransformerLM)
        config = EngineConfig() if config is None else config
        instance("config", config, EngineConfig)  # EngineConfig checked its own fields when it was made
        model_config = model.config
        if model_config.attn_backend == "triton":  # the triton backend's paged kernel needs a power of two
            power_of_two("block_size", config.block_size)
        if eos_token_id is not None:
            token_id("eos_token_id", eos_token_id, model_config.vocab_size)
        model.check_backend(training=False)  # the engine runs in eval mode; the paged kernel trusts this
        weight = model.tok_emb.weight
        num_blocks = config.pool_blocks(bytes_per_block(model_config, config.block_size, weight.dtype),
                                        model_config.max_seq_len, weight.device)
        if kv_connector is not None:
            instance("kv_connector", kv_connector, KVConnector)

        self.model = model.eval()
        self.config, self.model_config = config, model_config
        self.block_size, self.num_blocks = config.block_size, num_blocks
        self.eos_token_id = eos_token_id
        self.tokenizer = tokenizer
        self._structured: StructuredOutputManager | None = None  # built at the first constrained request
        self._structured_lock = threading.Lock()  # check_request may build it from a server's HTTP thread
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.max_num_seqs, config.enforce_eager,
                                  config.pack_linear_weights)
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.bind(model, self.runner.kv_cache, config.block_size)
        # the scheduler owns the counters (engine.scheduler.counters): it sees every step, finish and abort
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   kv_connector)
        self._handoff = PoolHandoff(model_config, self.runner, self.block_manager)
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self.kv_events = None  # a KVEventPublisher once publish_kv_events was called
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    # ----------------------------------------------------------------------------------- requests
    def add_request(self, prompt_token_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt (a list of token ids, or a 1-D integer tensor). Returns its request id.
        A request that could never run raises ValueError (an InvalidRequest) here, and nothing else is
        disturbed."""
        params = SamplingParams() if params is None else params
        prompt, _ = self.check_request(prompt_token_ids, params)
        return self.add_checked_request(prompt, params, request_id)

    def add_checked_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """add_request behind a door that already ran `check_request(prompt, params)` and got `prompt`
        back (a server's HTTP thread does, then hands the request to the engine thread): no check again."""
        seq = self._new_sequence(prompt, params, params.stops(self.eos_token_id), request_id)
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
        cfg = self.model_config
        instance("params", params, SamplingParams)
        prompt = self._prompt_list(prompt_token_ids)
        total = len(prompt) + params.max_tokens
        if total > cfg.max_seq_len:
            room = cfg.max_seq_len - len(prompt)  # what fits: the prompt and its new tokens share the context
            fits = f"max_tokens <= {room} fits after this prompt" if room > 0 else "shorten the prompt"
            raise InvalidRequest("max_tokens", f"prompt length {len(prompt)} + max_tokens {params.max_tokens} = "
                                               f"{total} exceeds the model's max_seq_len={cfg.max_seq_len}; {fits}")
        needed = blocks_for(total - 1, self.block_size)  # the last token is sampled, never written to the cache
        if needed > self.num_blocks:
            raise InvalidRequest("max_tokens", f"this request needs up to {needed} KV blocks of {self.block_size} "
                                               f"tokens but the pool has only num_blocks={self.num_blocks}; "
                                               "shorten it or give the engine more blocks")
        try:
            token_ids("stop_token_ids", params.stop_token_ids, cfg.vocab_size, empty=True)
        except ValueError as err:
            raise InvalidRequest("stop_token_ids", str(err)) from None
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
        return prompt, params.stops(self.eos_token_id)

    @property
    def structured_output(self) -> StructuredOutputManager:
        """The grammar compiler over this engine's vocabulary (xgrammar is imported on first use). Safe to
        call from a server's HTTP thread (check_request does): the manager locks its own cache."""
        if self.tokenizer is None:
            raise GrammarError("structured", "structured output needs the engine's tokenizer: "
                                             "LLMEngine(model, tokenizer=...)")
        with self._structured_lock:
            if self._structured is None:
                self._structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                          self.eos_token_id)
        return self._structured

    def _prompt_list(self, prompt_token_ids) -> list[int]:
        try:
            return token_ids("prompt_token_ids", prompt_token_ids, self.model_config.vocab_size)
        except ValueError as err:  # a TypeError (not a list at all) is the caller's bug, not a request to refuse
            raise InvalidRequest("prompt_token_ids", str(err)) from None

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. False if it is unknown or already finished."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(seq)
        seq.finish("abort")
        return True

    def publish_kv_events(self, publisher) -> None:
        """From now on, publish the prefix cache's changes after each step (engine/kv_events.py). The
        cache is reset first, so what subscribers learn starts from an empty pool: call it while the
        engine holds no request."""
        if self.requests or not self.block_manager.reset_prefix_cache():
            raise RuntimeError("publish_kv_events needs an engine with no request in flight")
        self.kv_events = publisher
        self.block_manager.events = [("cleared",)]
        publisher.publish(self.block_manager.drain_events())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (False, and nothing changed, while requests hold blocks)."""
        reset = self.block_manager.reset_prefix_cache()
        self._publish_kv_events()
        return reset

    # ------------------------------------------------------------- prefill/decode disaggregation
    def prefill_for_handoff(self, prompt_token_ids, params: SamplingParams | None = None) -> KVHandoff:
        """Run one request's prompt until its first token is sampled and hand back what another engine
        needs to decode it (see engine/handoff.py). The engine must have no other requests in flight.
        However it ends, the request leaves the engine: handed off (its blocks return to the pool, its
        prefix stays cached), finished at its first token, or aborted when a step or the K/V copy raised."""
        if self.requests:
            raise RuntimeError(f"prefill_for_handoff needs an engine with no other requests in flight (it has "
                               f"{len(self.requests)}): their outputs of the steps it runs would be lost")
        request_id = self.add_request(prompt_token_ids, params)
        seq = self.requests[request_id]
        try:
            first = None
            while first is None:  # a long prompt may take several steps (chunked prefill)
                first = next((out for out in self.step() if out.request_id == request_id), None)
            kv_handoff = self._handoff.export(seq, first)
        except BaseException:
            self.abort(request_id)  # still holding its blocks unless the failed step ended it already
            raise
        if not first.finished:
            self._forget(seq)
            self.scheduler.hand_off(seq)  # counted as handed off, not as aborted
        return kv_handoff

    def kv_buffer(self, num_tokens: int) -> torch.Tensor:
        """An empty (2, n_layer, num_tokens, Hkv, D) CPU tensor of the pool's dtype: where a receiver
        puts the K/V of a handoff before adopt_prefilled."""
        cfg = self.model_config
        positive_int("num_tokens", num_tokens)
        return torch.empty(2, cfg.n_layer, num_tokens, cfg.n_kv_heads, cfg.d_head, dtype=self.runner.dtype)

    def adopt_prefilled(self, kv_handoff: KVHandoff, params: SamplingParams | None = None,
                        request_id: str | None = None) -> str:
        """Take over a request another engine prefilled (prefill_for_handoff there, same params): its
        prompt K/V go into blocks of this pool, its first token is appended, and it joins the running
        batch, so the next steps decode it. Returns its request id here; the first token is not
        reported again by step(). max_num_seqs does not hold it back: the caller paces what it hands over.
        A handoff that does not fit this engine raises, naming the field of `kv_handoff` at fault."""
        params = SamplingParams() if params is None else params
        instance("kv_handoff", kv_handoff, KVHandoff)
        prompt, stops = self.check_request(kv_handoff.prompt_token_ids, params)
        matcher = None if params.structured is None else self.structured_output.matcher(params.structured)
        self._handoff.check(kv_handoff, prompt, stops, params, matcher)
        seq = self._new_sequence(prompt, params, stops, request_id)
        try:
            self._handoff.write_in(seq, kv_handoff)
        except BaseException:
            self._forget(seq)  # the request leaves no trace: its blocks went back already
            raise
        self.scheduler.add_running(seq)
        return seq.request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, and let the scheduler take in what came out. Returns
        one RequestOutput per request that produced a token in this step (a request still in the middle
        of its prefill produces none). If the forward pass raises, the requests of this step end with
        finish_reason "error" and the error propagates. With KV events on, the blocks the schedule
        entered into the prefix cache go out before the forward pass, what changed after it at the end."""
        try:
            return self._step()
        finally:
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.block_manager.drain_events())

    @torch.inference_mode()
    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        # announced before the (long) prefill runs, as vLLM's scheduler does: a router then sends the
        # requests for this prefix that arrive meanwhile here, instead of computing it again elsewhere
        self._publish_kv_events()
        if not plan.scheduled:
            assert not self.scheduler.has_unfinished(), "the scheduler made no progress"
            return []
        try:
            next_ids = self.runner.execute_model(plan.scheduled)
        except Exception:
            self._fail(plan.scheduled)
            raise
        if self.kv_connector is not None:  # the blocks this pass completed, before the update counts them
            self.kv_connector.save(plan.scheduled)
        outputs, finished = self.scheduler.update_from_output(plan, next_ids)
        for seq in finished:
            self._forget(seq)
        return outputs

    def _forget(self, seq: Sequence) -> None:
        """A request left the engine (finished, aborted, failed, handed off): drop what refers to it."""
        self.requests.pop(seq.request_id, None)
        self.runner.release(seq.request_id)

    def _fail(self, scheduled) -> None:
        """The forward pass raised: the requests in it end (finish_reason "error"), their half-written
        blocks leave the prefix cache, and the engine stays usable for the others."""
        for seq, _ in scheduled:
            self.block_manager.forget_uncomputed(seq)
            self.scheduler.finish(seq)
            seq.finish("error")
            self._forget(seq)

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
        """Counters since the engine started, and the pool as it is now (EngineStats as a dict)."""
        return self.engine_stats().as_dict()

    def engine_stats(self) -> EngineStats:
        """The one stats object: stats(), snapshot() and a server's metrics all read this."""
        store = None if self.kv_connector is None else self.kv_connector.stats()
        return EngineStats.of(self.scheduler.counters, self.block_manager, self.scheduler, self.runner.kv_cache.nbytes
                              // (self.num_blocks + 1) * self.num_blocks, store)

    def snapshot(self) -> EngineSnapshot:
        """The queues, each request's block table, the pool block by block and the stats, all from one
        moment, as plain frozen data for a server's metrics and live page (call it on the engine's thread)."""
        tiers = None if self.kv_connector is None else self.kv_connector.block_tiers(self.block_manager.blocks)
        return EngineSnapshot.of(self.scheduler, self.block_manager, self.engine_stats(),
                                 self.model_config.attn_backend,
                                 tiers)
