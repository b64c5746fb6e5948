"""Shared by the KV store tests (test_engine_kv_connector.py, test_engine_kv_tiers.py, test_server_kv_store.py):
a real redis-server on a free 127.0.0.1 port, in a temp dir, no persistence, stopped by the test (without
Debian's redis-server binary the tests that need it skip with a message); small models, a workload whose
prompts share a prefix, and the reference outputs."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time

import pytest
import torch

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM, generate
from mini_transformer.engine import EngineConfig, LLMEngine
from mini_transformer.engine.kv_connector import KVConnector

START_TIMEOUT_S = 10.0
VOCAB, MAX_TOKENS = 50, 6
HANG_GUARD_S = 30  # a liveness bound for the fault tests (they take about a second): hanging fails, slow does not
PARAMS = SamplingParams(max_tokens=MAX_TOKENS)


def make_model(style: str, seed: int = 0) -> TransformerLM:
    extra = dict(pos_emb="rope", n_kv_heads=2, norm="rmsnorm", ffn="swiglu", bias=False) if style == "llama" else {}
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layer=2, d_ff=64, max_seq_len=64,
                            init_std=0.2, **extra)
    torch.manual_seed(seed)
    return TransformerLM(cfg).eval()


def prompts_and_fillers():
    """Three prompts sharing a 35-token prefix; then fillers that push them out of a small pool."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, VOCAB, (35,), generator=gen).tolist()
    prompts = [base + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 8, 1)]
    fillers = [torch.randint(0, VOCAB, (40,), generator=gen).tolist() for _ in range(3)]
    return prompts, fillers


def reference(model, prompts) -> list[list[int]]:
    return [generate(model, torch.tensor([p]), MAX_TOKENS)[0].tolist() for p in prompts]


def small_engine(model, block_size: int, connector: KVConnector | None) -> LLMEngine:
    """A pool twice the longest request: the fillers evict the prompts' blocks (and preempt at times)."""
    longest = -(-(43 + MAX_TOKENS) // block_size)
    return LLMEngine(model, EngineConfig(block_size=block_size, num_blocks=2 * longest), kv_connector=connector)


def serve_twice(engine: LLMEngine, prompts, fillers) -> tuple[list, list]:
    """Prompts, fillers (evicting them from the pool), prompts again: the second time they can only come
    from the connector's tiers."""
    first = engine.generate(prompts, PARAMS, use_tqdm=False)
    engine.kv_connector.flush()
    engine.generate(fillers, PARAMS, use_tqdm=False)
    engine.kv_connector.flush()
    return first, engine.generate(prompts, PARAMS, use_tqdm=False)


def kv_block_bytes(model, block_size: int) -> int:
    """The formula: 2 (k, v) · L · block_size · Hkv · D · 4 bytes (float32)."""
    cfg = model.config
    return 2 * cfg.n_layer * block_size * cfg.n_kv_heads * cfg.d_head * 4


def value_bytes(model, block_size: int) -> int:
    """A stored value: 29 header bytes, the token ids (int64), the K/V, a 16-byte MAC."""
    return 29 + 8 * block_size + kv_block_bytes(model, block_size) + 16




def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_redis_server() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; .ci/run does it)")
    return binary


class RedisServer:
    """`redis-server --port N --save '' --dir tmp` (with `--requirepass P` when given a password); start(),
    stop(), kill(), pause()/resume() (SIGSTOP)."""

    def __init__(self, directory, port: int | None = None, password: str | None = None):
        self.binary = require_redis_server()
        self.directory, self.port, self.password = directory, port or free_port(), password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5,
                           socket_connect_timeout=5)

    def start(self) -> RedisServer:
        auth = [] if self.password is None else ["--requirepass", self.password]
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), *auth], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except Exception:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {START_TIMEOUT_S} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)  # alive, connections accepted, nothing answered: a slow server

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
