"""`mini-transformer cluster`: several `serve` processes behind vllm-router on this machine, in one command.

    mini-transformer cluster --checkpoint RUN --replicas 2 --policy kv_aware
    mini-transformer cluster --checkpoint RUN --pd 1:1 --redis

It starts a redis-server where asked (--redis), the servers on free ports of 127.0.0.1 (publishing KV
events when the policy is kv_aware; as KV producers and consumers with --pd), then vllm-router in front
of them; prints each command it ran and the router's address; and stops them all on Ctrl-C or SIGTERM.
On several machines the same pieces start one by one: run the printed commands there, with the hosts'
addresses instead of 127.0.0.1.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .._checks import integer
from ..parallel.launch import free_port

ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "kv_aware", "power_of_two", "consistent_hash",
                   "sticky_least_loaded")
PD_KV_EVENT_BLOCK_SIZE = 16  # vllm-router's --pd-kv-events assumes vLLM's default block size
START_TIMEOUT_S = 600.0  # bounds, not expectations: loading torch on a busy small machine is slow
STOP_TIMEOUT_S = 30.0
POLL_S = 0.2


def router_binary() -> str:
    """vllm-router beside this Python (a venv's bin/), else on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        raise ValueError("vllm-router is not installed (pip install vllm-router)")
    return found


@dataclass
class Piece:
    """One process of the cluster: its command, the URL it answers on, and once started its process."""

    name: str
    argv: list[str]
    url: str | None = None  # checked on /health until it answers
    kv_events: str | None = None  # the ZeroMQ endpoint its KV events come from
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None


class Cluster:
    """The processes of one cluster, planned at construction, started by start(), stopped by stop()."""

    def __init__(self, checkpoint: str, *, replicas: int = 2, pd: tuple[int, int] | None = None,
                 policy: str = "cache_aware", kv_store: str | None = None, redis: bool = False, port: int = 0,
                 block_size: int = 16, model_name: str | None = None, serve_args: tuple[str, ...] = (),
                 threads: int = 1, router_args: tuple[str, ...] = ()):
        integer("replicas", replicas, low=1)
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"policy={policy!r}; vllm-router's policies are {', '.join(ROUTER_POLICIES)}")
        if pd is not None and kv_store is None and not redis:
            raise ValueError("--pd needs a KV store the servers share: --kv-store URL or --redis")
        if pd is not None and policy == "kv_aware" and block_size != PD_KV_EVENT_BLOCK_SIZE:
            raise ValueError(f"--pd with kv_aware needs --block-size {PD_KV_EVENT_BLOCK_SIZE} (vllm-router's)")
        self.model_name = model_name or Path(checkpoint).resolve().name
        self.pieces: list[Piece] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="mini-transformer-cluster-") if redis else None
        if redis:
            redis_port = free_port()
            self.pieces.append(Piece("redis", ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                                               "--save", "", "--appendonly", "no", "--dir", self._tmp.name]))
            kv_store = f"redis://127.0.0.1:{redis_port}"
        self.kv_store = kv_store
        roles = [("replica", None)] * replicas if pd is None else [("prefill", "producer")] * pd[0] + \
            [("decode", "consumer")] * pd[1]
        serve = [sys.executable, "-m", "mini_transformer.cli", "serve", "--checkpoint", str(checkpoint),
                 "--model-name", self.model_name, "--block-size", str(block_size), "--log-level", "warning",
                 *(["--kv-store", kv_store] if kv_store else []), *serve_args]
        for i, (name, role) in enumerate(roles):
            server_port = free_port()
            events = f"tcp://127.0.0.1:{free_port()}" if policy == "kv_aware" and name != "decode" else None
            argv = [*serve, "--port", str(server_port), *(["--kv-role", role] if role else []),
                    *(["--kv-events-endpoint", events] if events else [])]
            self.pieces.append(Piece(f"{name} {i}", argv, f"http://127.0.0.1:{server_port}", events,
                                     {"OMP_NUM_THREADS": str(threads)}))
        self.router_url = f"http://127.0.0.1:{port or free_port()}"
        self.pieces.append(Piece("router", self._router_argv(policy, pd is not None, block_size, router_args),
                                 self.router_url))

    @property
    def servers(self) -> list[Piece]:
        return [p for p in self.pieces if p.name not in ("redis", "router")]

    def _router_argv(self, policy: str, pd: bool, block_size: int, extra: tuple[str, ...]) -> list[str]:
        argv = [router_binary(), "--host", "127.0.0.1", "--port", self.router_url.rsplit(":", 1)[1],
                "--policy", policy, "--prometheus-port", str(free_port()), "--log-level", "warning",
                "--worker-startup-check-interval", "1", "--health-check-interval-secs", "2"]
        if pd:
            argv.append("--vllm-pd-disaggregation")
            for piece in self.servers:
                argv += ["--prefill" if piece.name.startswith("prefill") else "--decode", piece.url]
                if piece.kv_events:
                    argv += ["--pd-kv-events", f"{piece.url}={piece.kv_events}"]
        else:
            argv += ["--worker-urls", *(piece.url for piece in self.servers)]
            for piece in self.servers:
                if piece.kv_events:
                    argv += ["--kv-event-source", f"{piece.url}={piece.kv_events}"]
            if policy == "kv_aware":  # the router asks each replica's /tokenize, and hashes the token ids itself
                argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", self.model_name]
        return argv + list(extra)

    def start(self, say=print, timeout: float = START_TIMEOUT_S) -> Cluster:
        """Start every piece in order (the router last: it waits for healthy workers), each command said
        first; return once the router answers. A piece that exits meanwhile raises ChildProcessError."""
        deadline = time.monotonic() + timeout
        try:
            for piece in self.pieces:
                say(f"[{piece.name}] {shlex.join(piece.argv)}")
                piece.proc = subprocess.Popen(piece.argv, env={**os.environ, **piece.env})
                if piece.name == "redis":
                    self._wait_port(piece, int(piece.argv[2]), deadline)
            for piece in self.pieces:
                if piece.url is not None:
                    self._wait_healthy(piece, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, piece: Piece, deadline: float) -> None:
        while True:
            self._check_alive(piece, deadline)
            try:
                with urllib.request.urlopen(piece.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or not healthy yet (an HTTPError is a URLError)
            time.sleep(POLL_S)

    def _wait_port(self, piece: Piece, port: int, deadline: float) -> None:
        while True:
            self._check_alive(piece, deadline)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(POLL_S)

    @staticmethod
    def _check_alive(piece: Piece, deadline: float) -> None:
        if piece.proc.poll() is not None:
            raise ChildProcessError(f"{piece.name} exited with status {piece.proc.returncode} while starting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{piece.name} did not come up in time")

    def exited(self) -> list[Piece]:
        return [p for p in self.pieces if p.proc is not None and p.proc.poll() is not None]

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to every piece still running (router first), then SIGKILL what is left after `timeout`."""
        running = [p.proc for p in reversed(self.pieces) if p.proc is not None and p.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _add_cluster(sub) -> None:
    p = sub.add_parser("cluster", help="servers behind vllm-router on this machine (Ctrl-C stops them all)")
    p.add_argument("--checkpoint", required=True, help="the checkpoint every server serves")
    p.add_argument("--replicas", type=int, default=2, help="servers that each prefill and decode (default 2)")
    p.add_argument("--pd", metavar="P:D", help="instead: P prefill servers (serve --kv-role producer) and D "
                   "decode servers (--kv-role consumer) sharing the KV store; the router sends a request to a "
                   "prefill server for its first token, then to a decode server (--vllm-pd-disaggregation)")
    p.add_argument("--policy", default="cache_aware", choices=ROUTER_POLICIES, help="vllm-router's choice of "
                   "server: kv_aware follows the KV events the servers publish, cache_aware guesses from the "
                   "request texts it has routed (default cache_aware)")
    store = p.add_mutually_exclusive_group()
    store.add_argument("--kv-store", metavar="URL", help="a Redis the servers share KV blocks through")
    store.add_argument("--redis", action="store_true", help="start a redis-server on a free port for that")
    p.add_argument("--port", type=int, default=8000, help="the router's port (servers get free ports)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block of every server")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each server (default 1)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every server, e.g. --serve-arg=--max-num-seqs=8 (repeatable)")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for vllm-router, e.g. --router-arg=--log-level=info (repeatable)")
    p.set_defaults(func=_run_cluster)


def _parse_pd(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    parts = value.split(":")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"--pd {value!r}: give P:D, two positive counts, e.g. 1:1")
    return int(parts[0]), int(parts[1])


def _run_cluster(args) -> None:
    integer("--port", args.port, low=1, high=65535)
    cluster = Cluster(args.checkpoint, replicas=args.replicas, pd=_parse_pd(args.pd), policy=args.policy,
                      kv_store=args.kv_store, redis=args.redis, port=args.port, block_size=args.block_size,
                      serve_args=tuple(args.serve_arg), threads=args.threads, router_args=tuple(args.router_arg))
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it like Ctrl-C
    reported: set[str] = set()
    try:
        cluster.start(say=lambda line: print(line, flush=True))
        for piece in cluster.servers:
            print(f"{piece.name}: {piece.url} (pid {piece.proc.pid}"
                  f"{', kv events ' + piece.kv_events if piece.kv_events else ''})", flush=True)
        print(f"router: {cluster.router_url} (OpenAI API under /v1; Ctrl-C stops everything)", flush=True)
        while True:
            for piece in cluster.exited():
                if piece.name not in reported:
                    reported.add(piece.name)
                    print(f"{piece.name} exited with status {piece.proc.returncode}", file=sys.stderr, flush=True)
            if "router" in reported:
                raise ChildProcessError("the router exited; stopping the cluster")
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("stopping the cluster", flush=True)
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)
