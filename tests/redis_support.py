"""A real redis-server for tests: on a free 127.0.0.1 port, in a temp dir, no persistence, stopped by the
test. Without Debian's redis-server binary the tests that need it skip with a message."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time

import pytest

START_TIMEOUT_S = 10.0


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
    """`redis-server --port N --save '' --dir tmp`; start(), stop(), kill(), pause()/resume() (SIGSTOP)."""

    def __init__(self, directory, port: int | None = None):
        self.binary = require_redis_server()
        self.directory, self.port = directory, port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, socket_connect_timeout=5)

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
