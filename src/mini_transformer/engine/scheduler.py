"""Scheduler: which sequences run in the next step, and how many of their tokens (vLLM V1's rule).

There are no prefill and decode phases. Every sequence has tokens (prompt + output) and a count of those
already computed; a step lets each chosen sequence catch up by up to its remaining count, all under one
token budget, `max_num_batched_tokens`. A running sequence that is decoding asks for 1 token, a new one
for its whole prompt (less what the prefix cache already holds); when the budget runs short, a prompt is
cut into chunks over several steps (chunked prefill). So one step mixes decode tokens and prefill chunks.

One step:
  1. RUNNING sequences first, oldest first. If the pool cannot hold a sequence's new tokens, the NEWEST
     running sequence is preempted (its blocks freed, its tokens recomputed later) until it fits.
  2. Then WAITING sequences in arrival order (FCFS), while the budget, `max_num_seqs` and the pool allow;
     the first that does not fit stops the loop, so nobody overtakes it. A step that preempted admits
     nobody (the pool is short already).

With a KV connector (kv_connector.py), a waiting sequence's lookup goes on past the device pool: the
full blocks a store tier holds next are allocated and loaded like cached blocks, and count as computed.

No starvation: a request that could never fit in the pool is refused when it is added, the oldest
running sequence is never preempted by a newer one, and a preempted sequence goes back to the FRONT of
the queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import RequestOutput, Sequence, SequenceStatus


@dataclass
class EngineCounters:
    """What the engine has done since it started. The scheduler owns them and alone adds to them (it
    sees every step, finish, abort and handoff); stats() and a server's metrics read them."""

    steps: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens_computed: int = 0
    prefix_cache_hit_tokens: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_handed_off: int = 0
    max_batched_tokens_seen: int = 0
    mixed_steps: int = 0  # steps with prefill chunks beside decode tokens
    kv_store_hit_tokens: int = 0  # prompt tokens loaded from the KV connector's tiers


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_cache_hit_tokens: int = 0  # tokens the sequences admitted this step found in the cache
    kv_store_hit_tokens: int = 0  # tokens they loaded from the KV connector's tiers

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 kv_connector=None):
        self.block_manager = block_manager
        self.kv_connector = kv_connector
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is the newest
        self.counters = EngineCounters()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose prompt is computed already (handed over by another engine) joins the running
        batch directly, as the newest; it holds its blocks."""
        assert seq.block_table and seq.num_computed_tokens > 0
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        self.counters.preemptions += len(out.preempted)
        self.counters.prefix_cache_hit_tokens += out.prefix_cache_hit_tokens
        self.counters.kv_store_hit_tokens += out.kv_store_hit_tokens
        return out

    def update_from_output(self, plan: SchedulerOutput, next_ids: list[int | None]
                           ) -> tuple[list[RequestOutput], list[Sequence]]:
        """After the step's forward pass: advance each scheduled sequence's computed tokens, append its
        sampled token (None: a prefill chunk that stops short of the last token), finish and free the
        sequences that are done. Returns the outputs and the sequences that finished (vLLM v1's name)."""
        c = self.counters
        c.steps += 1
        prefilling = [seq.num_computed_tokens < seq.num_prompt_tokens for seq, _ in plan.scheduled]
        c.mixed_steps += any(prefilling) and not all(prefilling)  # prefill beside decode
        c.max_batched_tokens_seen = max(c.max_batched_tokens_seen, plan.num_batched_tokens)
        outputs, finished = [], []
        for (seq, num_new), token in zip(plan.scheduled, next_ids, strict=True):
            start = seq.num_computed_tokens
            in_prompt = max(0, min(start + num_new, seq.num_prompt_tokens) - start)
            c.prefill_tokens_computed += in_prompt
            c.decode_tokens_computed += num_new - in_prompt
            seq.num_computed_tokens += num_new
            if token is None:
                continue
            added = seq.append_token(token)  # False: the grammar refused it (the request ends, "error")
            if seq.is_finished:
                self.finish(seq)
                finished.append(seq)
                c.requests_finished += 1
            logprobs = None if seq.params.logprobs is None else (seq.output_logprobs[-1],)
            prompt_logprobs = None
            if seq.needs_prompt_logprobs:  # complete by now: the first token needed the whole prompt computed
                prompt_logprobs, seq.prompt_logprobs_sent = tuple(seq.prompt_logprobs), True
            outputs.append(RequestOutput(seq.request_id, [token] if added else [], seq.is_finished,
                                         seq.finish_reason, logprobs, prompt_logprobs))
        return outputs, finished

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()  # the newest running sequence
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        manager, connector, bs = self.block_manager, self.kv_connector, self.block_manager.block_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = manager.find_cached_blocks(seq)
            stored = connector.lookup(seq, len(cached)) if connector is not None else 0  # blocks a tier gives
            num_new = min(seq.num_tokens - (len(cached) + stored) * bs, budget)
            if not manager.can_admit(seq, cached, stored * bs + num_new):
                break  # FCFS: the head of the queue waits for room, and so does everyone behind it
            self.waiting.popleft()
            manager.admit(seq, cached)
            if stored:  # fresh blocks for the stored run, filled from the tier: computed without a forward pass
                allocated = manager.allocate_slots(seq, stored * bs)
                assert allocated, "can_admit promised room"
                loaded = seq.block_table[len(cached):]
                connector.load(seq, loaded, [manager.blocks[b].generation for b in loaded])
                seq.num_computed_tokens += stored * bs
                out.kv_store_hit_tokens += stored * bs
            allocated = manager.allocate_slots(seq, num_new)
            assert allocated, "can_admit promised room"
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            out.prefix_cache_hit_tokens += seq.num_cached_tokens
            budget -= num_new

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: free every block, forget what was computed, go back to the front of the queue.
        The tokens produced so far stay; they are prefilled again with the prompt."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a finished (or failed) sequence out of the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def abort(self, seq: Sequence) -> None:
        """finish(), counted as an abort (LLMEngine.abort)."""
        self.finish(seq)
        self.counters.requests_aborted += 1

    def hand_off(self, seq: Sequence) -> None:
        """finish(), counted as a handoff: another engine decodes it (LLMEngine.prefill_for_handoff)."""
        self.finish(seq)
        self.counters.requests_handed_off += 1
