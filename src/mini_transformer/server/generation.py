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
from collections.abc import AsyncIterator, Awaitable, Callable

from ..inference.sampling import SamplingParams
from .engine_loop import Accepted, EngineLoop, Failed, RequestHandle, StepOutput
from .protocol import ErrorResponse
from .text import IncrementalText, TextCodec

DISCONNECT_POLL_S = 0.5  # a waiting request checks this often whether its client or the engine thread has gone


class Generation:
    def __init__(self, engine_loop: EngineLoop, codec: TextCodec, prompts: list[list[int]],
                 params: list[list[SamplingParams]], stop: list[str]):
        self.engine_loop = engine_loop
        self.eos_token_id = codec.eos_token_id  # the engine's EOS (build_context gives it)
        self.prompts = prompts
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices = [(prompt, p) for prompt, ps in zip(prompts, params, strict=True) for p in ps]
        self.texts = [IncrementalText(codec, stop) for _ in self.choices]
        self.n_tokens = [0] * len(self.choices)
        self.finish_reasons: list[str | None] = [None] * len(self.choices)
        self.handles: list[RequestHandle] = []
        self._early: list[tuple[int, StepOutput]] = []  # outputs that came while waiting for acceptance
        self._reserved = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(self.n_tokens)

    async def start(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Submit every choice and wait until the engine has taken them all (or refused one: raise).
        The wait polls like `events`: a client gone raises ClientGone, a dead engine thread a 503."""
        self.engine_loop.reserve(len(self.choices))
        self._reserved = len(self.choices)
        for index, (prompt, params) in enumerate(self.choices):
            self.handles.append(self.engine_loop.submit(prompt, params, self.queue, index))
        accepted = 0
        while accepted < len(self.choices):
            index, item = await self._next(is_disconnected)
            if isinstance(item, Failed):
                raise item.error
            if isinstance(item, Accepted):
                accepted += 1
            else:
                self._early.append((index, item))

    async def events(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None
                     ) -> AsyncIterator[tuple[int, str, str | None]]:
        """Yield (choice index, new text, finish_reason or None) until every choice has finished."""
        pending = len(self.choices)
        while pending:
            for index, item in (await self._next_outputs(is_disconnected)).items():
                if self.handles[index].done:  # ended by a stop string; its last outputs were in flight
                    continue
                piece, finish = self._advance(index, item)
                if finish is None and not piece:
                    continue
                if finish is not None:
                    self.finish_reasons[index] = finish
                    pending -= 1
                    self.handles[index].done = True
                yield index, piece, finish

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
            merged[index] = item if before is None else StepOutput(
                before.new_token_ids + item.new_token_ids, item.finished, item.finish_reason)
        return merged

    def _advance(self, index: int, item: StepOutput) -> tuple[str, str | None]:
        """Feed a choice's new ids to its text; (text to send, finish_reason or None)."""
        text = self.texts[index]
        self.n_tokens[index] += len(item.new_token_ids)
        ids = item.new_token_ids
        if item.finish_reason == "stop" and ids and ids[-1] in self.choices[index][1].stops(self.eos_token_id):
            ids = ids[:-1]  # the stop token ends the text but is not part of it (OpenAI's rule)
        piece = text.add(ids, final=item.finished)
        finish = item.finish_reason if item.finished else None
        if text.stopped:  # a stop string: the choice ends here (abort it if the engine is still on it)
            if not item.finished:
                self.engine_loop.abort(self.handles[index])
            finish = "stop"
        return piece, finish

    async def _next(self, is_disconnected):
        """The next queued item; every DISCONNECT_POLL_S without one, check the client and the engine thread."""
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if is_disconnected is not None and await is_disconnected():
                    raise ClientGone() from None
                if not self.engine_loop.alive and self.queue.empty():
                    raise ErrorResponse(503, "the engine thread is not running", code="engine_dead") from None

    def close(self) -> None:
        """Abort what still runs and give the capacity back; safe to call more than once."""
        for handle in self.handles:
            if not handle.done:
                handle.done = True
                self.engine_loop.abort(handle)
        self.engine_loop.release(self._reserved)
        self._reserved = 0

    async def collect(self, is_disconnected) -> list[dict]:
        """Run to the end; [{"text", "finish_reason"}] per choice (a non-streamed response)."""
        async for _ in self.events(is_disconnected):
            pass
        return [{"text": t.out, "finish_reason": r} for t, r in zip(self.texts, self.finish_reasons, strict=True)]


class ClientGone(Exception):
    """The client of a non-streamed request disconnected; its choices were aborted."""

