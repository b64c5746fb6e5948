"""Shared by the tests/test_server*.py files: tiny checkpoints written to tmp dirs, and a real uvicorn
server on a free port of 127.0.0.1, run in a thread of the test process and stopped by the test."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn
from support import save_char_checkpoint

from mini_transformer import SamplingParams
from mini_transformer.engine import EngineConfig, LLMEngine
from mini_transformer.server import build_context, create_app

# every character a test prompt or the default chat template uses
TEXT = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?'-\n"
STARTUP_TIMEOUT_S = 60.0  # bounds, not expectations: generous for a 2-core machine at load 10


def make_char_checkpoint(path, *, max_seq_len: int = 96, seed: int = 0, preset: str = "tiny"):
    """support.save_char_checkpoint over this file's TEXT: (model in eval, tokenizer)."""
    _, model, tokenizer = save_char_checkpoint(path, max_seq_len, text=TEXT, seed=seed, preset=preset)
    return model, tokenizer


def offline_greedy(model, prompts: list[list[int]], max_tokens: int, *, block_size: int = 4) -> list[list[int]]:
    """The reference: the same prompts through an offline LLMEngine, greedy."""
    engine = LLMEngine(model, EngineConfig(block_size=block_size, num_blocks=256))
    return engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)


class ServerThread:
    """uvicorn serving `create_app(ctx)` on a socket bound to 127.0.0.1:0 (a free port), in a thread."""

    def __init__(self, ctx):
        self.ctx = ctx
        # proto=IPPROTO_TCP, as uvicorn's own bind has: asyncio sets TCP_NODELAY only on connections of such a
        # socket, and without it each answer on a kept-alive connection waited ~40 ms (Nagle + delayed ACK)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(ctx), log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()
        assert not self.thread.is_alive(), "the test server did not stop"

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Wait (bounded) until no request is in flight on the HTTP side and the engine holds no request
        and no block; return its stats. The engine's snapshot is rebuilt at most every 0.1 s while busy,
        so an idle one counts only if it was taken after the HTTP side let go of its last request."""
        deadline = time.monotonic() + timeout
        let_go_at = None
        while True:
            if let_go_at is None and self.ctx.engine_loop.in_flight == 0:
                let_go_at = time.time()
            state = self.ctx.engine_loop.state()
            if (let_go_at is not None and state["time"] >= let_go_at and not state["running"]
                    and not state["waiting"] and state["blocks_in_use"] == 0):
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine did not drain: {state['running']} {state['waiting']}")
            time.sleep(0.02)


@contextlib.contextmanager
def slowed_engine(server, seconds_per_step: float = 0.01):
    """Each engine step of `server` first sleeps `seconds_per_step`: for tests that must act while a
    request still runs. A 360-token request then lasts at least 3.6 s on any machine, where an idle
    2-core one needs ~0.3 s, so a test thread that loses the CPU for a moment no longer finds the request
    already finished. The sleep releases the GIL, so the test's own thread is not slowed."""
    engine = server.ctx.engine_loop.engine
    step = engine.step

    def slow_step():
        time.sleep(seconds_per_step)
        return step()

    engine.step = slow_step  # the engine thread looks `engine.step` up on every turn
    try:
        yield server
    finally:
        del engine.step  # the class's method again


@contextlib.contextmanager
def running_server(checkpoint, **options):
    """build_context(checkpoint, **options), served on a free port for the `with` block."""
    server = ServerThread(build_context(checkpoint, **options)).start()
    try:
        yield server
    finally:
        server.stop()
