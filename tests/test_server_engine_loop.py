"""The engine thread's wake-up: an idle engine thread blocks on its inbox and a new request wakes it at
once. Checked on a real server (127.0.0.1, a free port) with the idle wait set to an hour: a request sent
while the thread is blocked is answered within the client's timeout, a small fraction of that hour, so
it cannot have waited for the wait to run out. The inbox is watched, not timed, to know the thread is
blocked on it when the request goes out."""

import json
import queue
import threading
import time

import httpx
import pytest
from server_support import ServerThread, make_char_checkpoint, offline_greedy

from mini_transformer.engine import EngineConfig
from mini_transformer.server import build_context
from mini_transformer.server import engine_loop as engine_loop_module

HOUR_S = 3600.0
BOUND_S = 120.0  # every wait of the test: a bound, not an expectation (a request takes well under 1 s)


class WatchedInbox(queue.SimpleQueue):
    """The engine loop's inbox; `waiting` is set while the engine thread is blocked in get(), and
    `timeouts` records how long each blocking get was allowed to wait."""

    def __init__(self):
        super().__init__()
        self.waiting = threading.Event()
        self.timeouts: list[float | None] = []

    def get(self, block=True, timeout=None):
        self.timeouts.append(timeout)
        self.waiting.set()
        try:
            return super().get(block, timeout)
        finally:
            self.waiting.clear()


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)


@pytest.fixture
def idle_server(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_loop_module, "IDLE_WAIT_S", HOUR_S)
    model, tokenizer = make_char_checkpoint(tmp_path, max_seq_len=64)
    ctx = build_context(tmp_path, config=EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4), model_name="tiny")
    inbox = ctx.engine_loop._inbox = WatchedInbox()  # before the engine thread starts (server start)
    server = ServerThread(ctx).start()
    try:
        yield server, inbox, model, tokenizer
    finally:
        server.stop()


def complete(server, prompt: str, max_tokens: int, stream: bool) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    with httpx.Client(base_url=server.url, timeout=BOUND_S) as client:
        if not stream:
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]
        text = ""
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_wakes_the_idle_engine_thread_without_waiting_out_its_idle_wait(idle_server, stream):
    server, inbox, model, tokenizer = idle_server
    assert BOUND_S < HOUR_S / 10  # answered within the bound = not after the hour's wait ran out
    for prompt in ("First request", "Second request"):  # the second finds the thread idle after the first
        wait_until(inbox.waiting.is_set, "the engine thread blocks on its inbox")
        assert inbox.timeouts[-1] == HOUR_S  # the thread is in the hour-long wait, not a short poll
        text = complete(server, prompt, 6, stream)
        expected = tokenizer.decode(offline_greedy(model, [tokenizer.encode(prompt)], 6)[0])
        assert text == expected
    assert server.ctx.engine_loop.alive
