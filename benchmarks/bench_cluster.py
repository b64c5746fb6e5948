"""Serving past one process: `mini-transformer serve` replicas behind vllm-router, each row against its
peer measured in the same run. Every server has 1 torch thread; the model is a Llama-style one with
random weights over a character vocabulary (one token per character), so prompts are plain text.

  tenants  8 shared system prompts, requests in random order with short tails and outputs, a few at a
           time: prompt tokens computed across 2 replicas and output tokens/s for round_robin,
           round_robin with a shared Redis KV store, cache_aware (the router guesses from request text)
           and kv_aware (the router follows the replicas' KV events, where `serve` publishes them)
  scale    no sharing: 2 replicas against 1 behind the same router, output tokens/s
  pd       requests decoding while long prompts keep arriving: time per output token (p50/p99 of the
           streamed tokens' gaps) with 1 prefill + 1 decode server (`--kv-role`, vllm-router
           --vllm-pd-disaggregation, KV through Redis) against 2 colocated replicas; the greedy texts of
           both must be equal, and the decode server computes at most one block of each prompt
  kill     a replica killed (SIGKILL) while requests flow: failures among those in flight then, and among
           those sent after; the router's health view of the killed worker

    python benchmarks/bench_cluster.py --quick          # a few minutes on 2 cores
    python benchmarks/bench_cluster.py --workloads pd kill --plot cluster.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from _common import load_average, table
from tqdm import tqdm

from mini_transformer import TransformerConfig, TransformerLM
from mini_transformer.tokenizer import CharTokenizer

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?'-\n"
WORKLOADS = ("tenants", "scale", "pd", "kill")
START_TIMEOUT_S = 300  # a bound for a server to load on a busy machine, not an expectation


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--quick", action="store_true", help="smaller model and workloads: a short run")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--system-len", type=int, default=512, help="tokens of each shared system prompt")
    p.add_argument("--tenant-requests", type=int, default=64)
    p.add_argument("--scale-requests", type=int, default=32)
    p.add_argument("--long-len", type=int, default=512, help="tokens of each long prompt (pd)")
    p.add_argument("--decode-tokens", type=int, default=64, help="output tokens of each decoding request (pd)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (closed loop)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="PNG", help="one panel per workload")
    args = p.parse_args(argv)
    if args.quick:
        args.n_layer, args.d_model, args.system_len, args.long_len = 4, 256, 256, 256
        args.tenant_requests, args.scale_requests, args.decode_tokens = 24, 12, 32
    return args


# ------------------------------------------------------------------------------------- processes
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, what: str, proc=None, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start")
        time.sleep(0.2)


@dataclass
class Cluster:
    """The processes of one configuration (redis-server, servers, vllm-router), all stopped by close()."""

    checkpoint: Path
    args: argparse.Namespace
    procs: list = field(default_factory=list)
    servers: list = field(default_factory=list)  # (process, url)

    def redis(self, directory: str) -> str:
        port = free_port()
        self.procs.append(subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port),
                                            "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir",
                                            directory], stdout=subprocess.DEVNULL))
        import redis

        wait_until(lambda: redis.Redis(port=port, socket_timeout=1).ping(), "redis-server", self.procs[-1])
        return f"redis://127.0.0.1:{port}"

    def server(self, *flags: str) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "mini_transformer.cli", "serve", "--checkpoint", str(self.checkpoint),
               "--port", str(port), "--model-name", "bench", "--block-size", str(self.args.block_size),
               "--log-level", "warning", *flags]
        proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        self.procs.append(proc)
        self.servers.append((proc, url))
        return url

    def router(self, *flags: str) -> str:
        port = free_port()
        binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        self.procs.append(subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
                                            str(free_port()), "--log-level", "error", "--worker-startup-check-interval",
                                            "1", "--health-check-interval-secs", "1", *flags],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for proc, url in self.servers:
            wait_until(lambda u=url: httpx.get(u + "/health", timeout=2).status_code == 200, url, proc)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "bench", "prompt": "warm", "max_tokens": 1}).status_code == 200, "vllm-router", self.procs[-1])
        return url

    def prompt_tokens_computed(self) -> int:
        return sum(httpx.get(u + "/v1/engine/state", timeout=10).json()["stats"]["prefill_tokens_computed"]
                   for p, u in self.servers if p.poll() is None)

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def serve_supports(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "mini_transformer.cli", "serve", "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    return flag in out


# -------------------------------------------------------------------------------------- requests
@dataclass
class Result:
    ok: bool
    text: str = ""
    sent: float = 0.0
    done: float = 0.0
    gaps: list[float] = field(default_factory=list)  # seconds per token between streamed chunks


async def complete(client: httpx.AsyncClient, prompt: str, max_tokens: int, stream: bool) -> Result:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    result = Result(False, sent=time.perf_counter())
    try:
        if not stream:
            response = await client.post("/v1/completions", json=body)
            result.ok = response.status_code == 200
            result.text = response.json()["choices"][0]["text"] if result.ok else ""
        else:
            await _stream(client, body, result)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError):
        result.ok = False
    result.done = time.perf_counter()
    return result


async def _stream(client: httpx.AsyncClient, body: dict, result: Result) -> None:
    last = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        result.ok = response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.ok = False
                return
            piece, now = chunk["choices"][0]["text"], time.perf_counter()
            if piece and last is not None:  # a chunk may carry several tokens: one per character here
                result.gaps += [(now - last) / len(piece)] * len(piece)
            last = now if piece else last
            result.text += piece


async def closed_loop(url: str, jobs: list[tuple[str, int]], concurrency: int, desc: str, stream=False,
                      on_result=None) -> list[Result]:
    """Send `jobs` (prompt, max_tokens) `concurrency` at a time, in order; results in job order."""
    results: list[Result | None] = [None] * len(jobs)
    todo = iter(range(len(jobs)))
    bar = tqdm(total=len(jobs), desc=desc, unit="req", leave=False)

    async def worker(client):
        for i in todo:
            results[i] = await complete(client, *jobs[i], stream)
            bar.update()
            if on_result is not None:
                on_result(results)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    bar.close()
    return results


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(CHARS[:62]) for _ in range(n))


def tokens_per_s(results: list[Result]) -> float:
    return sum(len(r.text) for r in results) / (max(r.done for r in results) - min(r.sent for r in results))


# ------------------------------------------------------------------------------------- workloads
def tenants(args, checkpoint: Path, tmp: str) -> list[dict]:
    rng = random.Random(args.seed)
    systems = [text(rng, args.system_len) for _ in range(8)]
    jobs = [(rng.choice(systems) + text(rng, 16), 8) for _ in range(args.tenant_requests)]
    policies = ["round_robin", "round_robin+redis", "cache_aware", "kv_aware"]
    events = serve_supports("--kv-events-endpoint")
    rows = []
    for policy in policies:
        if policy == "kv_aware" and not events:
            print("kv_aware: skipped, this `serve` publishes no KV events (--kv-events-endpoint)")
            continue
        cluster = Cluster(checkpoint, args)
        try:
            flags, router_flags = [], ["--policy", policy.split("+")[0]]
            if policy.endswith("redis"):
                flags = ["--kv-store", cluster.redis(tmp)]
            urls = []
            for _ in range(2):
                endpoint = f"tcp://127.0.0.1:{free_port()}"
                urls.append(cluster.server(*flags, *(["--kv-events-endpoint", endpoint] if policy == "kv_aware"
                                                    else [])))
                if policy == "kv_aware":
                    router_flags += ["--kv-event-source", f"{urls[-1]}={endpoint}"]
            router = cluster.router("--worker-urls", *urls, *router_flags)
            before = cluster.prompt_tokens_computed()
            results = asyncio.run(closed_loop(router, jobs, args.concurrency, policy))
            computed = cluster.prompt_tokens_computed() - before
        finally:
            cluster.close()
        rows.append(dict(policy=policy, computed=computed, failed=sum(not r.ok for r in results),
                         tok_s=tokens_per_s(results), texts=[r.text for r in results]))
    for row in rows:
        row["computed_vs_rr"] = f"{row['computed'] / rows[0]['computed']:.2f}x"
        row["same_text"] = row["texts"] == rows[0]["texts"]
    return rows


def scale(args, checkpoint: Path, tmp: str) -> list[dict]:
    rng = random.Random(args.seed + 1)
    jobs = [(text(rng, 64), 64) for _ in range(args.scale_requests)]
    rows = []
    for replicas in (1, 2):
        cluster = Cluster(checkpoint, args)
        try:
            urls = [cluster.server() for _ in range(replicas)]
            router = cluster.router("--worker-urls", *urls, "--policy", "round_robin")
            results = asyncio.run(closed_loop(router, jobs, 2 * args.concurrency, f"{replicas} replica(s)"))
        finally:
            cluster.close()
        rows.append(dict(setup=f"{replicas} replica" + "s" * (replicas > 1), tok_s=tokens_per_s(results),
                         failed=sum(not r.ok for r in results)))
    return rows


async def pd_load(url: str, args, decode_jobs, long_prompts) -> tuple[list[Result], int]:
    """Decoding requests streamed `args.concurrency` at a time while one long prompt after another is sent."""
    finished = asyncio.Event()

    async def longs():
        sent = 0
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            while not finished.is_set() and sent < len(long_prompts):
                await complete(client, long_prompts[sent], 2, False)
                sent += 1
        return sent

    task = asyncio.create_task(longs())
    results = await closed_loop(url, decode_jobs, args.concurrency, "decoding", stream=True)
    finished.set()
    return results, await task


def pd(args, checkpoint: Path, tmp: str) -> list[dict]:
    rng = random.Random(args.seed + 2)
    decode_jobs = [(text(rng, 32), args.decode_tokens) for _ in range(2 * args.concurrency)]
    long_prompts = [text(rng, args.long_len) for _ in range(200)]
    rows = []
    for setup in ("2 colocated", "PD 1:1"):
        cluster = Cluster(checkpoint, args)
        try:
            if setup == "PD 1:1":
                store = cluster.redis(tmp)
                p = cluster.server("--kv-store", store, "--kv-role", "producer")
                d = cluster.server("--kv-store", store, "--kv-role", "consumer")
                router = cluster.router("--vllm-pd-disaggregation", "--prefill", p, "--decode", d,
                                        "--policy", "round_robin")
            else:
                router = cluster.router("--worker-urls", cluster.server(), cluster.server(), "--policy", "round_robin")
            first = httpx.get(cluster.servers[-1][1] + "/v1/engine/state", timeout=10).json()["stats"]
            results, longs = asyncio.run(pd_load(router, args, decode_jobs, long_prompts))
            last = httpx.get(cluster.servers[-1][1] + "/v1/engine/state", timeout=10).json()["stats"]
        finally:
            cluster.close()
        gaps = sorted(g for r in results for g in r.gaps)
        per_prompt = (last["prefill_tokens_computed"] - first["prefill_tokens_computed"]) / (len(results) + longs)
        rows.append(dict(setup=setup, tpot_p50_ms=1e3 * statistics.median(gaps),
                         tpot_p99_ms=1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], long_prompts=longs,
                         decode_computed=round(per_prompt, 1), failed=sum(not r.ok for r in results),
                         texts=[r.text for r in results]))
    rows[1]["same_text"] = rows[1]["texts"] == rows[0]["texts"]
    return rows


def kill(args, checkpoint: Path, tmp: str) -> list[dict]:
    rng = random.Random(args.seed + 3)
    jobs = [(text(rng, 48), 16) for _ in range(6 * args.concurrency)]
    cluster, killed_at = Cluster(checkpoint, args), []
    try:
        urls = [cluster.server(), cluster.server()]
        router = cluster.router("--worker-urls", *urls, "--policy", "round_robin")
        victim = cluster.servers[1][0]

        def on_result(results):
            if not killed_at and sum(r is not None for r in results) >= len(results) // 3:
                victim.send_signal(signal.SIGKILL)
                killed_at.append(time.perf_counter())

        results = asyncio.run(closed_loop(router, jobs, args.concurrency, "kill", on_result=on_result))
        time.sleep(3)  # a few of the router's health checks (one a second)
        healthy = {w["url"]: w["is_healthy"] for w in httpx.get(router + "/workers", timeout=10).json()["workers"]}
        answers = {}
        for url in urls:  # what each replica's own /metrics says: the killed one does not answer at all
            try:
                answers[url] = httpx.get(url + "/metrics", timeout=2).status_code == 200
            except httpx.TransportError:
                answers[url] = False
    finally:
        cluster.close()
    t = killed_at[0]
    in_flight = [r for r in results if r.sent < t < r.done]
    after = [r for r in results if r.sent >= t]
    return [dict(requests="in flight at the kill", sent=len(in_flight), failed=sum(not r.ok for r in in_flight)),
            dict(requests="sent after the kill", sent=len(after), failed=sum(not r.ok for r in after)),
            *(dict(requests=f"{'killed' if url == urls[1] else 'live'} replica", sent="", failed="",
                   router_healthy=healthy.get(url), metrics_answer=answers[url]) for url in urls)]


# ---------------------------------------------------------------------------------------- report
def make_checkpoint(path: Path, args) -> None:
    cfg = TransformerConfig.from_preset("llama-tiny", vocab_size=len(CHARS), d_model=args.d_model,
                                        n_heads=args.d_model // 64, n_kv_heads=2, n_layer=args.n_layer,
                                        max_seq_len=max(args.system_len, args.long_len) + 256, attn_backend="sdpa")
    torch.manual_seed(args.seed)
    TransformerLM(cfg).save_pretrained(path)
    CharTokenizer(list(CHARS)).save(path)


COLUMNS = {
    "tenants": ({"policy": "policy", "computed": "prompt tokens computed", "computed_vs_rr": "vs round_robin",
                 "tok_s": "output tok/s", "failed": "failed", "same_text": "same text"}, ("tok_s", "round_robin")),
    "scale": ({"setup": "setup", "tok_s": "output tok/s", "failed": "failed"}, ("tok_s", "1 replica")),
    "pd": ({"setup": "setup", "tpot_p50_ms": "TPOT p50 ms", "tpot_p99_ms": "TPOT p99 ms",
            "long_prompts": "long prompts", "decode_computed": "decode server tokens computed / prompt",
            "failed": "failed", "same_text": "same text"}, ("tpot_p99_ms", "2 colocated")),
    "kill": ({"requests": "requests", "sent": "sent", "failed": "failed", "router_healthy": "router: healthy",
              "metrics_answer": "/metrics answers"}, None),
}


def main(argv=None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the finally blocks stop every process
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp) / "ckpt", args)
        for name in args.workloads:
            results[name] = globals()[name](args, Path(tmp) / "ckpt", tmp)
    print(f"\n{args.n_layer}x{args.d_model} model, block {args.block_size}, 1 thread per server, {load_average()}")
    for name, rows in results.items():
        columns, ratio = COLUMNS[name]
        print(f"\n{name}\n" + table(rows, columns, ratio=ratio, higher_is_better=name != "pd"))
    if args.plot:
        plot(results, args.plot)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(n, k) for n, k in (("tenants", "tok_s"), ("scale", "tok_s"), ("pd", "tpot_p99_ms")) if n in results]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4 * max(1, len(panels)), 3.5), squeeze=False)
    for ax, (name, key) in zip(axes[0], panels, strict=False):
        rows = results[name]
        ax.bar([str(next(iter(r.values()))) for r in rows], [r[key] for r in rows], color="#5fb3f9")
        ax.set_title(f"{name}: {key}")
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
