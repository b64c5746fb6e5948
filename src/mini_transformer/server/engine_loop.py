"""One thread owns the engine; every HTTP request talks to it through queues.

The engine is not thread-safe, so exactly one thread ever touches it: it takes new requests and aborts
from an inbox, runs `engine.step()`, and hands each request's new token ids to that request's asyncio
queue (`loop.call_soon_threadsafe`). While nothing is in flight it sleeps on the inbox, and a request
put there wakes it at once (a blocking get, not a poll: a lone request's time to first token is the
HTTP hops plus its prefill step). Requests from all clients meet in the same engine steps: that is
continuous batching seen from the server.

    HTTP handler --submit()--> inbox --thread--> engine.add_checked_request / step / abort
    HTTP handler <--asyncio.Queue-- Accepted | StepOutput | Failed <--thread--

Door checks happen in the HTTP layer before `submit` (the engine's own `check_request`), so the thread
adds each request with `add_checked_request` and does not check it again. What is left to fail here is
an engine crash, or any other error in a loop turn (every request in flight and in the inbox fails with
500 and the loop goes on). Should the thread end anyway, `alive` turns False: /health answers 503 and
waiting requests notice it.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from ..inference.sampling import SamplingParams
from .metrics import ServerMetrics
from .protocol import ErrorResponse
from .state import engine_state

STATE_INTERVAL_S = 0.1  # the engine state snapshot is rebuilt at most this often while busy
RATE_WINDOW_S = 2.0  # tokens/s is measured over this trailing window
ERROR_PAUSE_S = 0.05  # after an unexpected error: a fault that repeats every turn must not spin a core
RETRY_AFTER_S = 1  # the Retry-After of a 429, in seconds: in-flight requests free their places quickly
IDLE_WAIT_S = 0.5  # an idle engine thread republishes its state this often; a new request wakes it at once


@dataclass
class Accepted:
    """The engine took the request (add_request returned)."""


@dataclass
class StepOutput:
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    logprobs: tuple = ()  # the engine's TokenLogprob per new token, when the request asked for logprobs
    prompt_logprobs: tuple = ()  # TokenLogprob (None for the first) per prompt token, when asked for

    def then(self, later: StepOutput) -> StepOutput:
        """This output followed by a later one of the same choice, as one."""
        return StepOutput(self.new_token_ids + later.new_token_ids, later.finished, later.finish_reason,
                          self.logprobs + later.logprobs, self.prompt_logprobs + later.prompt_logprobs)


@dataclass
class Failed:
    error: ErrorResponse


@dataclass(eq=False)
class RequestHandle:
    """One choice in flight: the engine thread writes (index, item) to `queue`, the asyncio side reads it
    (the choices of one HTTP request share a queue, `index` tells them apart)."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int = 0
    arrival: float = field(default_factory=time.monotonic)
    engine_id: object = None  # the engine's request id, set by the engine thread
    scheduled_at: float | None = None  # the start of the first step that ran it (queue time ends here)
    first_token_at: float | None = None
    last_output_at: float | None = None
    n_output: int = 0
    cancelled: bool = False  # aborted (engine thread's view)
    done: bool = False  # finished or aborted (asyncio side's view)

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))


def _put_all(batch: list[tuple[RequestHandle, object]]) -> None:
    """On the event loop: put each item into its request's queue."""
    for handle, item in batch:
        handle.queue.put_nowait((handle.index, item))


def _push_quietly(handle: RequestHandle, item) -> None:
    """Push even while things break: a closed event loop means nobody is waiting any more."""
    try:
        handle.push(item)
    except RuntimeError:
        pass


class EngineLoop:
    def __init__(self, engine, metrics: ServerMetrics, *, max_waiting: int):
        self.engine, self.metrics = engine, metrics
        # requests in flight beyond the running batch and max_waiting queued are refused (429)
        self.capacity = engine.config.max_num_seqs + max_waiting
        self.in_flight = 0  # counted on the asyncio side: submitted and not yet ended
        self.draining = False  # shutting down: no new requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[object, RequestHandle] = {}  # engine request id -> handle (engine thread only)
        self._handling: RequestHandle | None = None  # the inbox item _handle is working on (engine thread)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._state_lock = threading.Lock()
        self._unscheduled: set[RequestHandle] = set()  # added, not yet seen leave the engine's waiting queue
        self._state: dict = {}
        self._state_time = 0.0
        self._recent_tokens: collections.deque = collections.deque()  # (time, tokens) within RATE_WINDOW_S
        self._tokens_total = 0

    # ------------------------------------------------------------------ the asyncio side
    def start(self) -> None:
        self._publish_state(force=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """False once the engine thread has ended (or before it started): nothing would answer a request."""
        return self._thread.is_alive()

    def submit(self, prompt_ids: list[int], params: SamplingParams, outbox: asyncio.Queue, index: int
               ) -> RequestHandle:
        """Queue one choice for the engine; its news go to `outbox` tagged with `index`.
        Admission (429, 503) is `reserve`'s job, called first."""
        handle = RequestHandle(prompt_ids, params, asyncio.get_running_loop(), outbox, index)
        self._inbox.put(("add", handle))
        return handle

    def reserve(self, n: int) -> None:
        """Count n new choices in flight, or refuse them all (429) when that would pass the capacity."""
        if self.draining:
            raise ErrorResponse(503, "the server is shutting down", code="server_shutting_down")
        if not self.alive:
            raise ErrorResponse(503, "the engine thread is not running", code="engine_dead")
        if self.in_flight + n > self.capacity:
            raise ErrorResponse(
                429, f"too many requests waiting: {self.in_flight} in flight, room for {self.capacity} "
                     "(--max-num-seqs running + --max-waiting queued); retry later", code="too_many_requests",
                headers={"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += n

    def release(self, n: int) -> None:
        self.in_flight -= n

    def abort(self, handle: RequestHandle) -> None:
        """Stop a choice (client gone, stop string seen); its blocks are freed at the next loop turn."""
        self._inbox.put(("abort", handle))

    def state(self) -> dict:
        with self._state_lock:
            return self._state

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while not self._stop.is_set():
                try:
                    self._turn()
                except Exception as err:  # a bug anywhere in a turn must not leave a request waiting forever
                    self._fail_everything(ErrorResponse(500, f"engine loop failed: {type(err).__name__}: {err}"))
                    self._stop.wait(ERROR_PAUSE_S)
        finally:  # stopping, or the error handling itself broke: nobody may wait on a dead thread
            self._fail_everything(ErrorResponse(503, "the server is shutting down", code="server_shutting_down"))

    def _turn(self) -> None:
        """One loop turn: take the inbox, run one engine step, hand out its outputs."""
        self._drain_inbox(block=not self._active)
        if not self._active:
            self._publish_state(force=True)
            return
        started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as err:  # an engine bug must not kill the server: fail what is in flight
            self._fail_all(ErrorResponse(500, f"engine step failed: {type(err).__name__}: {err}"))
            return
        self._note_scheduled(started)
        self._deliver(outputs, time.monotonic())
        self._publish_state(force=not self._active)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handling = item[1]  # taken from the inbox, not yet active: failed too if _handle raises
            self._handle(*item)
            self._handling = None
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, handle: RequestHandle | None) -> None:
        if kind == "add" and not handle.cancelled:
            # checked by the HTTP handler (engine.check_request, app.py): not checked a second time here
            handle.engine_id = self.engine.add_checked_request(handle.prompt_ids, handle.params)
            self._active[handle.engine_id] = handle
            self._unscheduled.add(handle)
            self.metrics.prompt_tokens.inc(len(handle.prompt_ids))
            handle.push(Accepted())
        elif kind == "abort":
            handle.cancelled = True
            if self._active.pop(handle.engine_id, None) is not None:
                self.engine.abort(handle.engine_id)
                self._finished(handle, "abort", time.monotonic())

    def _note_scheduled(self, step_started: float) -> None:
        """Requests that left the engine's waiting queue in this step: their queue time ends at its start."""
        if not self._unscheduled:
            return
        waiting = {seq.request_id for seq in self.engine.scheduler.waiting}
        for handle in [h for h in self._unscheduled if h.engine_id not in waiting]:
            handle.scheduled_at = step_started
            self._unscheduled.discard(handle)

    def _deliver(self, outputs, now: float) -> None:
        """Hand each request its new ids: one wake-up of the event loop per step, not one per request."""
        produced, batch = 0, []
        for out in outputs:
            handle = self._active.get(out.request_id)
            if handle is None:  # aborted while the step ran
                continue
            new_ids = out.new_token_ids  # plain ints already: the runner read them back with .tolist()
            produced += len(new_ids)
            if new_ids:
                self.metrics.observe_output(handle, now)
            handle.n_output += len(new_ids)
            if out.finished:
                del self._active[out.request_id]
                self._finished(handle, out.finish_reason, now)
            batch.append((handle, StepOutput(new_ids, out.finished, out.finish_reason, tuple(out.logprobs or ()),
                                             tuple(out.prompt_logprobs or ()))))
        if batch:  # every handle lives on the server's one event loop
            batch[0][0].loop.call_soon_threadsafe(_put_all, batch)
        self.metrics.generation_tokens.inc(produced)
        self._tokens_total += produced
        self._recent_tokens.append((now, produced))

    def _finished(self, handle: RequestHandle, reason: str, now: float) -> None:
        self._unscheduled.discard(handle)
        self.metrics.observe_finished(handle, reason, now)

    def _fail_all(self, error: ErrorResponse) -> None:
        for engine_id, handle in list(self._active.items()):
            try:
                self.engine.abort(engine_id)
            except Exception:  # the engine is already broken; the request fails either way
                pass
            _push_quietly(handle, Failed(error))
        self._active.clear()
        self._unscheduled.clear()

    def _fail_everything(self, error: ErrorResponse) -> None:
        """Fail every request the thread knows of: the active ones, the one being handled, the inbox's."""
        waiting = [] if self._handling is None else [self._handling]
        self._handling = None
        while True:
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                waiting.append(handle)
        self._fail_all(error)
        for handle in waiting:
            if not handle.cancelled:
                _push_quietly(handle, Failed(error))

    def _tokens_per_s(self, now: float) -> float:
        while self._recent_tokens and self._recent_tokens[0][0] < now - RATE_WINDOW_S:
            self._recent_tokens.popleft()
        return sum(n for _, n in self._recent_tokens) / RATE_WINDOW_S

    def _publish_state(self, force: bool) -> None:
        """Refresh the gauges and the /v1/engine/state snapshot (at most every STATE_INTERVAL_S while busy)."""
        now = time.monotonic()
        if not force and now - self._state_time < STATE_INTERVAL_S:
            return
        snapshot = self.engine.snapshot()  # frozen, and consistent: taken here, on the engine's own thread
        m = self.metrics
        m.running.set(snapshot.num_running)
        m.waiting.set(snapshot.num_waiting)
        m.observe_pool(snapshot.num_blocks, snapshot.blocks_in_use)
        m.catch_up(snapshot.stats)
        m.observe_kv_store(snapshot.stats)
        if self.engine.kv_events is not None:
            m.observe_kv_events(self.engine.kv_events.published, self.engine.kv_events.dropped)
        state = engine_state(snapshot, {h.engine_id: h for h in self._active.values()})
        state.update(time=time.time(), tokens_per_s=round(self._tokens_per_s(now), 2),
                     tokens_generated=self._tokens_total, stats=dict(snapshot.stats))
        with self._state_lock:
            self._state, self._state_time = state, now
