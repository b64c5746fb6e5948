"""Generation: the choices of one HTTP request read back from the engine thread's outputs. Driven here by
hand (a recording stand-in for the engine loop), so the order of outputs is exactly the one under test."""

import asyncio
import contextlib
from typing import NamedTuple

import pytest

from mini_transformer import SamplingParams
from mini_transformer.server.app import ClosingStreamingResponse
from mini_transformer.server.engine_loop import Accepted, StepOutput
from mini_transformer.server.generation import Generation, Options
from mini_transformer.server.protocol import ErrorResponse


class Codec:
    eos_token_id = None

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class Handle:
    """What the engine loop's submit returns for one choice."""

    done = False

    def __init__(self, index):
        self.index = index


class RecordingLoop:
    """Takes submissions and aborts and remembers them; the test plays the engine thread's part.
    `accepts=False`: a submission is never answered with Accepted (the engine thread is gone)."""

    def __init__(self, accepts=True):
        self.handles, self.aborted, self.reserved = [], [], 0
        self.alive, self.accepts = True, accepts

    def reserve(self, n):
        self.reserved += n

    def release(self, n):
        self.reserved -= n

    def submit(self, prompt, params, outbox, index):
        handle = Handle(index)
        self.handles.append(handle)
        if self.accepts:
            outbox.put_nowait((index, Accepted()))
        return handle

    def abort(self, handle):
        self.aborted.append(handle.index)


def ids(text):
    return [ord(c) for c in text]


def test_outputs_queued_together_are_merged_and_a_stopped_choice_ignores_late_outputs():
    async def scenario():
        loop = RecordingLoop()
        params = [SamplingParams(max_tokens=8, seed=s) for s in (0, 1)]
        gen = Generation(loop, Codec(), [[1, 2]], [params], Options(stop=("X",)))
        await gen.start()
        # choice 0 hits the stop string; outputs the engine made before the abort still arrive after it
        for index, item in [(0, StepOutput(ids("ab"), False, None)), (1, StepOutput(ids("c"), False, None)),
                            (0, StepOutput(ids("Xd"), False, None))]:
            gen.queue.put_nowait((index, item))
        events = gen.events()
        first = [await anext(events), await anext(events)]
        gen.queue.put_nowait((0, StepOutput(ids("e"), False, None)))  # late, for the stopped choice
        gen.queue.put_nowait((1, StepOutput(ids("fg"), True, "length")))
        rest = [e async for e in events]
        gen.close()
        return loop, gen, first + rest

    loop, gen, events = asyncio.run(scenario())
    # choice 0's two outputs went out as one piece, cut before "X"; choice 1 ran to its end
    assert [e[:3] for e in events] == [(0, "ab", "stop"), (1, "c", None), (1, "fg", "length")]
    assert loop.aborted == [0] and [c.finish_reason for c in gen.choices] == ["stop", "length"]
    assert [c.out for c in gen.choices] == ["ab", "cfg"] and loop.reserved == 0


class Logprob(NamedTuple):  # the engine's TokenLogprob, as the server reads it
    token_id: int
    logprob: float
    top: tuple = ()


def test_echo_puts_the_prompt_and_its_logprobs_first_and_score_only_drops_the_generated_token():
    """Prompt logprobs arrive with the first output (the first prompt token's is None); with echo they go
    out before the text, once. max_tokens=0 (score_only): the one token the engine made is not sent."""
    async def scenario(score_only):
        loop = RecordingLoop()
        gen = Generation(loop, Codec(), [ids("hi")], [[SamplingParams(max_tokens=2)]],
                         Options(echo=True, logprobs=True, score_only=score_only))
        await gen.start()
        prompt_lps = (None, Logprob(ord("i"), -1.5, ((ord("i"), -1.5),)))
        gen.queue.put_nowait((0, StepOutput(ids("!"), False, None, (Logprob(ord("!"), -0.5),), prompt_lps)))
        gen.queue.put_nowait((0, StepOutput(ids("?"), True, "length", (Logprob(ord("?"), -2.0),))))
        events = [e async for e in gen.events()]
        gen.close()
        return gen, events

    gen, events = asyncio.run(scenario(False))
    assert gen.choices[0].out == "hi!?" and gen.completion_tokens == 2
    assert [(t.token_id, t.logprob) for t in gen.choices[0].tokens] == [
        (ord("h"), None), (ord("i"), -1.5), (ord("!"), -0.5), (ord("?"), -2.0)]
    assert events[0].text == "hi!?" and events[-1].finish_reason == "length"  # queued together: one event
    gen, events = asyncio.run(scenario(True))
    assert gen.choices[0].out == "hi" and gen.completion_tokens == 0
    assert [t.token_id for t in gen.choices[0].tokens] == ids("hi")
    assert [e.finish_reason for e in events] == ["length"]


def test_start_gives_up_with_503_when_the_engine_thread_is_gone():
    """Submitted, never accepted, and the engine thread has died: start() must end, not wait forever."""
    loop = RecordingLoop(accepts=False)
    loop.alive = False
    gen = Generation(loop, Codec(), [[1]], [[SamplingParams(max_tokens=3)]], Options())

    async def run():
        try:
            await asyncio.wait_for(gen.start(), timeout=10)
        finally:
            gen.close()

    with pytest.raises(ErrorResponse) as err:
        asyncio.run(run())
    assert err.value.status == 503 and loop.reserved == 0 and loop.aborted == [0]


def test_a_stream_that_never_starts_still_closes_its_generation():
    """The client is gone before the first chunk: the body generator never runs, on_close still must."""
    closed = []

    async def body():
        yield "never sent"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the client has gone")

    response = ClosingStreamingResponse(body(), on_close=lambda: closed.append(True), media_type="text/event-stream")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST", "path": "/"}
    with contextlib.suppress(Exception):  # starlette turns the OSError into ClientDisconnect
        asyncio.run(response(scope, receive, send))
    assert closed == [True]
