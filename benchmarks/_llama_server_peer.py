"""bench_serving.py --llama-server-peer: llama.cpp's `llama-server` binary as a peer, fed over HTTP.

The server gets one slot per request (`-np`), continuous batching, an f32 KV cache and flash attention off
(its f32 path), `-t`/`-tb` threads, and no prompt cache (`--cache-ram 0`, `cache_prompt: false`: every
round computes every prompt, as ours does). All requests go to `/completion` at once, as token ids, from
one client thread each; the reply carries the generated ids (`return_tokens`). CPU seconds are the
server process's own (all its threads), read from the OS before and after a run.

Build the binary from llama.cpp's source (the llama-cpp-python sdist ships it under vendor/llama.cpp):

    cmake -S "$LLAMA_CPP_DIR" -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF
    cmake --build build --target llama-server -j 2        # LLAMA_SERVER=build/bin/llama-server
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A running llama-server on 127.0.0.1 with `slots` slots of `slot_len` tokens each."""

    def __init__(self, binary: str, gguf: Path, threads: int, slots: int, slot_len: int, timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * slot_len),
               "-b", "512", "-ub", "512", "-fa", "off", "-ctk", "f32", "-ctv", "f32", "--cache-ram", "0",
               "-cb", "--no-warmup"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # ggml's OpenMP build honours a cap from the caller
        # its log goes to a file: a pipe nobody reads fills after a few hundred requests and the server blocks
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True, env=env)
        self.slots = slots
        self._wait_healthy(timeout)
        self._ps = psutil.Process(self.proc.pid)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"llama-server exited (rc {self.proc.returncode}):\n{self.log.read()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        self.close()
        raise SystemExit(f"llama-server not healthy within {timeout:.0f} s")

    def _complete(self, prompt: list[int], new_tokens: int) -> list[int]:
        body = json.dumps({"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "ignore_eos": True,
                           "cache_prompt": False, "return_tokens": True, "stream": False}).encode()
        request = urllib.request.Request(self.url + "/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            return json.loads(r.read())["tokens"]

    def _cpu(self) -> float:
        t = self._ps.cpu_times()
        return t.user + t.system

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, float]:
        """Every prompt at once (one client thread each). Returns (outputs, seconds, server CPU seconds)."""
        cpu, start = self._cpu(), time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            outputs = list(pool.map(lambda p: self._complete(p, new_tokens), prompts))
        return outputs, time.perf_counter() - start, self._cpu() - cpu

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()
