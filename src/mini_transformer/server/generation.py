"""One HTTP request's choices in flight: submitted together, read back as (choice, text piece, finish).

A request with p prompts and n choices each becomes p * n engine requests (choice i*n + j is prompt i's
j-th choice, OpenAI's numbering). The n choices of a prompt carry the same prompt ids, so the engine's
prefix cache lets them share the prompt's full KV blocks. All choices report into one asyncio queue;
`events()` turns token ids into text (stop strings cut here, and the choice is aborted in the engine).
Whatever way the reader leaves — done, error, client gone, task cancelled — `close()` aborts what is
still running and gives the capacity back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from ..inference.sampling import SamplingParams
from .engine_loop import Accepted, EngineLoop, Failed, RequestHandle, StepOutput
from .logprobs import Scored, scored
from .protocol import ErrorResponse
from .text import IncrementalText, TextCodec

DISCONNECT_POLL_S = 0.25  # a request checks this often whether its client or the engine thread has gone


@dataclass(frozen=True)
class Options:
    """How the text of every choice is made: echo puts the prompt in front (with its logprobs when
    `logprobs`); score_only (max_tokens=0 with echo) returns only the prompt, and the one token the
    engine generated to get there is dropped; include_stop keeps a stop string / stop token in the text;
    stop strings are looked for only once a choice has min_tokens tokens (vLLM's rule)."""

    stop: tuple[str, ...] = ()
    echo: bool = False
    score_only: bool = False
    logprobs: bool = False
    include_stop: bool = False
    min_tokens: int = 0


class Event(NamedTuple):
    index: int  # the choice
    text: str  # new text ('' if none)
    finish_reason: str | None
    tokens: list[Scored]  # the tokens behind the new text, with their logprobs (when asked for)


@dataclass(eq=False)
class _Choice:
    prompt: list[int]
    params: SamplingParams
    text: IncrementalText
    n_tokens: int = 0  # generated (the usage count)
    finish_reason: str | None = None
    out: str = ""  # everything sent: the echoed prompt, then the generated text
    tokens: list[Scored] = field(default_factory=list)  # everything sent, with logprobs
    prompt_entries: list = field(default_factory=list)  # the engine's prompt logprobs, as they arrive
    echoed: bool = False


class Generation:
    def __init__(self, engine_loop: EngineLoop, codec: TextCodec, prompts: list[list[int]],
                 params: list[list[SamplingParams]], options: Options):
        self.engine_loop, self.codec, self.options = engine_loop, codec, options
        self.eos_token_id = codec.eos_token_id  # the engine's EOS (build_context gives it)
        self.prompts = prompts
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices = [_Choice(prompt, p, IncrementalText(codec, list(options.stop), options.include_stop,
                                                           options.min_tokens))
                        for prompt, ps in zip(prompts, params, strict=True) for p in ps]
        self.handles: list[RequestHandle] = []
        self._early: list[tuple[int, StepOutput]] = []  # outputs that came while waiting for acceptance
        self._reserved = 0
        self._check_at = 0.0  # when _next next asks whether the client is still there

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.n_tokens for c in self.choices)

    async def start(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Submit every choice and wait until the engine has taken them all (or refused one: raise).
        The wait polls like `events`: a client gone raises ClientGone, a dead engine thread a 503."""
        self.engine_loop.reserve(len(self.choices))
        self._reserved = len(self.choices)
        for index, choice in enumerate(self.choices):
            self.handles.append(self.engine_loop.submit(choice.prompt, choice.params, self.queue, index))
        accepted = 0
        while accepted < len(self.choices):
            index, item = await self._next(is_disconnected)
            if isinstance(item, Failed):
                raise item.error
            if isinstance(item, Accepted):
                accepted += 1
            else:
                self._early.append((index, item))

    async def events(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[Event]:
        """Yield an Event whenever a choice has new text or tokens, or finishes, until all have finished."""
        pending = len(self.choices)
        while pending:
            for index, item in (await self._next_outputs(is_disconnected)).items():
                if self.handles[index].done:  # ended by a stop string; its last outputs were in flight
                    continue
                event = self._advance(index, item)
                if event.finish_reason is None and not event.text and not event.tokens:
                    continue
                if event.finish_reason is not None:
                    pending -= 1
                    self.handles[index].done = True
                yield event

    async def _next_outputs(self, is_disconnected) -> dict[int, StepOutput]:
        """Wait for news, then take everything already queued, merged per choice: when the HTTP side falls
        behind the engine, a choice's tokens of several steps go out in one chunk (vLLM does the same)."""
        items, self._early = self._early, []
        if not items:
            items.append(await self._next(is_disconnected))
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        merged: dict[int, StepOutput] = {}
        for index, item in items:
            if isinstance(item, Failed):
                raise item.error
            if isinstance(item, Accepted):
                continue
            before = merged.get(index)
            merged[index] = item if before is None else before.then(item)
        return merged

    def _advance(self, index: int, item: StepOutput) -> Event:
        """Feed a choice's new ids to its text; the Event to send (maybe empty)."""
        choice, options = self.choices[index], self.options
        choice.prompt_entries += item.prompt_logprobs or ()
        head_text, head = self._echo(choice)
        finish = item.finish_reason if item.finished else None
        if options.score_only:  # the prompt alone: the generated token is not part of the answer
            return self._sent(index, head_text, "length" if finish else None, head)
        ids = item.new_token_ids
        choice.n_tokens += len(ids)
        if (item.finish_reason == "stop" and ids and not options.include_stop
                and ids[-1] in choice.params.stops(self.eos_token_id)):
            ids = ids[:-1]  # the stop token ends the text but is not part of it (OpenAI's rule)
        used_before = choice.text.tokens_used
        piece = choice.text.add(ids, final=item.finished)
        used = choice.text.tokens_used - used_before  # after a stop string, the rest is not part of the text
        tokens = scored(ids[:used], item.logprobs[:used]) if options.logprobs else []
        if choice.text.stopped:  # a stop string: the choice ends here (abort it if the engine is still on it)
            if not item.finished:
                self.engine_loop.abort(self.handles[index])
            finish = "stop"
        return self._sent(index, head_text + piece, finish, head + tokens)

    def _echo(self, choice: _Choice) -> tuple[str, list[Scored]]:
        """The prompt's text (and scored tokens) once, before the choice's first text, with echo on; it
        waits until the engine has reported every prompt token's logprob when logprobs are asked for."""
        if not self.options.echo or choice.echoed:
            return "", []
        if self.options.logprobs and len(choice.prompt_entries) < len(choice.prompt):
            return "", []
        choice.echoed = True
        tokens = scored(choice.prompt, choice.prompt_entries) if self.options.logprobs else []
        n = choice.params.logprobs or 0  # the engine may score more alternatives, for prompt_logprobs
        return self.codec.decode(choice.prompt), [t._replace(top=t.top[:n]) for t in tokens]

    def _sent(self, index: int, text: str, finish: str | None, tokens: list[Scored]) -> Event:
        choice = self.choices[index]
        choice.out += text
        choice.tokens += tokens
        if finish is not None:
            choice.finish_reason = finish
        return Event(index, text, finish, tokens)

    async def _next(self, is_disconnected):
        """The next queued item; every DISCONNECT_POLL_S, whether or not items flow, check that the client
        and the engine thread are still there (a busy engine must not hide a client that left)."""
        while True:
            if time.monotonic() >= self._check_at:
                self._check_at = time.monotonic() + DISCONNECT_POLL_S
                if is_disconnected is not None and await is_disconnected():
                    raise ClientGone()
                if not self.engine_loop.alive and self.queue.empty():
                    raise ErrorResponse(503, "the engine thread is not running", code="engine_dead")
            try:
                return await asyncio.wait_for(self.queue.get(), self._check_at - time.monotonic())
            except TimeoutError:
                continue

    def close(self) -> None:
        """Abort what still runs and give the capacity back; safe to call more than once."""
        for handle in self.handles:
            if not handle.done:
                handle.done = True
                self.engine_loop.abort(handle)
        self.engine_loop.release(self._reserved)
        self._reserved = 0

    async def collect(self, is_disconnected) -> list[_Choice]:
        """Run to the end; every choice with its whole text and tokens (a non-streamed response)."""
        async for _ in self.events(is_disconnected):
            pass
        return self.choices


class ClientGone(Exception):
    """The client of a non-streamed request disconnected; its choices were aborted."""
