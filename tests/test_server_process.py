"""`mini-transformer serve` as its own process: it starts on a free port, answers, and on SIGTERM lets the
running request finish, refuses new connections, and exits 0. Every wait is bounded; the test kills
the process itself if anything goes wrong."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from server_support import make_char_checkpoint

STARTUP_TIMEOUT_S = 120  # importing torch on a busy 2-core machine can take tens of seconds


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def server_process(tmp_path):
    make_char_checkpoint(tmp_path, max_seq_len=384)
    port = free_port()
    cmd = [sys.executable, "-m", "mini_transformer.cli", "serve", "--checkpoint", str(tmp_path), "--port", str(port),
           "--model-name", "tiny", "--block-size", "4", "--max-num-seqs", "4", "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"the server exited early: {proc.stdout.read()}"
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_serve_answers_then_sigterm_finishes_the_running_request_and_exits_0(server_process):
    proc, url = server_process
    out = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
    assert "<html" in httpx.get(url + "/", timeout=10).text

    body = {"model": "tiny", "prompt": "Finish me", "max_tokens": 360, "temperature": 0, "stream": True}
    chunks_after_sigterm, finish, done = 0, None, False
    with httpx.Client(base_url=url, timeout=60) as client, client.stream("POST", "/v1/completions",
                                                                         json=body) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # running
        proc.send_signal(signal.SIGTERM)
        for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks_after_sigterm += 1
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    assert done and finish == "length" and chunks_after_sigterm > 0
    assert proc.wait(timeout=60) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
