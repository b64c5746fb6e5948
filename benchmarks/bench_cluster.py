"""Serving past one process: `mini-transformer serve` replicas behind vllm-router, each row against its
peer measured in the same run. Every server has 1 torch thread; the model is a Llama-style one with
random weights over a character vocabulary (one token per character), so prompts are plain text.

  tenants  8 shared system prompts, requests in random order with short tails and outputs, a few at a
           time: prompt tokens computed across 2 replicas and output tokens/s for round_robin,
           round_robin with a shared Redis KV store, cache_aware (the router guesses from request text)
           and kv_aware (the router follows the KV events the replicas publish: it learns of a prefix
           once a replica has scheduled it, and picks the replica of least cost, new prompt tokens plus
           the work a replica has in hand, so a busy replica that holds a prefix may lose to an idle one)
  scale    no sharing: 2 replicas against 1 behind the same router, output tokens/s
  pd       requests decoding while long prompts arrive at a fixed rate (--long-every, the same offered
           load for both setups): time per output token (p50/p99 of the
           streamed tokens' gaps) with 1 prefill + 1 decode server (`--kv-role`, vllm-router
           --vllm-pd-disaggregation, KV through Redis) against 2 colocated replicas; the greedy texts of
           both must be equal, and the decode server computes at most one block of each prompt
  kill     a replica killed (SIGKILL) while requests flow: failures among those in flight then, and among
           those sent after; the router's health view of the killed worker

    python benchmarks/bench_cluster.py --quick          # minutes: most of it is starting servers
    python benchmarks/bench_cluster.py --workloads pd kill --plot cluster.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import signal
import statistics
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
from mini_transformer.cli.cluster_command import Cluster
from mini_transformer.tokenizer import CharTokenizer

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?'-\n"
WORKLOADS = ("tenants", "scale", "pd", "kill")


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
    p.add_argument("--long-every", type=float, default=1.0, help="seconds between long prompts (pd)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (closed loop)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="PNG", help="one panel per workload")
    if p.parse_known_args(argv)[0].quick:  # smaller defaults; flags given still win
        p.set_defaults(n_layer=4, d_model=256, system_len=256, long_len=256, tenant_requests=24, scale_requests=12,
                       decode_tokens=32, long_every=0.5)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------- processes
@contextlib.contextmanager
def cluster(checkpoint: Path, args, **options):
    """The pieces `mini-transformer cluster` starts (redis-server, servers, vllm-router), started quietly,
    warmed up with one request through the router, stopped when the block ends."""
    pieces = Cluster(str(checkpoint), model_name="bench", block_size=args.block_size, **options)
    with contextlib.redirect_stdout(io.StringIO()):
        pieces.start(say=lambda line: None)
    try:
        httpx.post(pieces.router_url + "/v1/completions", json={"model": "bench", "prompt": "warm", "max_tokens": 1},
                   timeout=300).raise_for_status()
        yield pieces
    finally:
        pieces.stop()


def prompt_tokens_computed(pieces: Cluster) -> int:
    """Across the servers still running: prompt tokens each engine computed (not loaded, not cached)."""
    return sum(httpx.get(p.url + "/v1/engine/state", timeout=10).json()["stats"]["prefill_tokens_computed"]
               for p in pieces.servers if p.proc.poll() is None)


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
def tenants(args, checkpoint: Path) -> list[dict]:
    rng = random.Random(args.seed)
    systems = [text(rng, args.system_len) for _ in range(8)]
    jobs = [(rng.choice(systems) + text(rng, 16), 8) for _ in range(args.tenant_requests)]
    rows = []
    for policy in ("round_robin", "round_robin+redis", "cache_aware", "kv_aware"):
        with cluster(checkpoint, args, replicas=2, policy=policy.split("+")[0], redis=policy.endswith("redis")) as c:
            before = prompt_tokens_computed(c)
            results = asyncio.run(closed_loop(c.router_url, jobs, args.concurrency, policy))
            computed = prompt_tokens_computed(c) - before
        rows.append(dict(policy=policy, computed=computed, failed=sum(not r.ok for r in results),
                         tok_s=tokens_per_s(results), texts=[r.text for r in results]))
    for row in rows:
        row["computed_vs_rr"] = f"{row['computed'] / rows[0]['computed']:.2f}x"
        row["same_text"] = row["texts"] == rows[0]["texts"]
    return rows


def cpu_seconds(pieces: Cluster) -> float:
    """User + system CPU time the servers have used so far (Linux's /proc; nan elsewhere)."""
    try:
        fields = [Path(f"/proc/{p.proc.pid}/stat").read_text().rsplit(")", 1)[1].split() for p in pieces.servers]
    except OSError:
        return float("nan")
    return sum(int(f[11]) + int(f[12]) for f in fields) / os.sysconf("SC_CLK_TCK")


def scale(args, checkpoint: Path) -> list[dict]:
    """Output tokens/s, and per server CPU second: on a machine whose cores are busy with other work,
    a second replica gets little more CPU, and the throughput says so."""
    rng = random.Random(args.seed + 1)
    jobs = [(text(rng, 64), 64) for _ in range(args.scale_requests)]
    rows = []
    for replicas in (1, 2):
        with cluster(checkpoint, args, replicas=replicas, policy="round_robin") as c:
            before = cpu_seconds(c)
            results = asyncio.run(closed_loop(c.router_url, jobs, 2 * args.concurrency, f"{replicas} replica(s)"))
            used = cpu_seconds(c) - before
        rows.append(dict(setup=f"{replicas} replica" + "s" * (replicas > 1), tok_s=tokens_per_s(results),
                         cpu_s=used, tok_per_cpu_s=sum(len(r.text) for r in results) / used,
                         failed=sum(not r.ok for r in results)))
    return rows


async def pd_load(url: str, args, decode_jobs, long_prompts) -> tuple[list[Result], int]:
    """Decoding requests streamed `args.concurrency` at a time while a long prompt arrives every
    `args.long_every` seconds (open loop: the same arrivals whatever the servers do with them)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        longs: list[asyncio.Task] = []

        async def arrivals():
            for prompt in long_prompts:
                longs.append(asyncio.create_task(complete(client, prompt, 2, False)))
                await asyncio.sleep(args.long_every)

        task = asyncio.create_task(arrivals())
        results = await closed_loop(url, decode_jobs, args.concurrency, "decoding", stream=True)
        task.cancel()
        for long in longs:  # the ones still running are abandoned: the servers abort them
            long.cancel()
        await asyncio.gather(task, *longs, return_exceptions=True)
    return results, len(longs)


def pd(args, checkpoint: Path) -> list[dict]:
    rng = random.Random(args.seed + 2)
    decode_jobs = [(text(rng, 32), args.decode_tokens) for _ in range(2 * args.concurrency)]
    long_prompts = [text(rng, args.long_len) for _ in range(200)]
    rows = []
    for setup, options in (("2 colocated", dict(replicas=2)), ("PD 1:1", dict(pd=(1, 1), redis=True))):
        with cluster(checkpoint, args, policy="round_robin", **options) as c:
            decoder = c.servers[-1].url  # the decode server of the pair

            def stats(url=decoder):
                return httpx.get(url + "/v1/engine/state", timeout=10).json()["stats"]

            first = stats()
            results, longs = asyncio.run(pd_load(c.router_url, args, decode_jobs, long_prompts))
            last = stats()
        gaps = sorted(g for r in results for g in r.gaps)
        served = sum(last[k] - first[k] for k in ("requests_finished", "requests_aborted"))
        per_prompt = (last["prefill_tokens_computed"] - first["prefill_tokens_computed"]) / served
        rows.append(dict(setup=setup, tpot_p50_ms=1e3 * statistics.median(gaps),
                         tpot_p99_ms=1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], long_prompts=longs,
                         decode_computed=round(per_prompt, 1), failed=sum(not r.ok for r in results),
                         texts=[r.text for r in results]))
    rows[1]["same_text"] = rows[1]["texts"] == rows[0]["texts"]
    return rows


def kill(args, checkpoint: Path) -> list[dict]:
    rng = random.Random(args.seed + 3)
    jobs = [(text(rng, 48), 16) for _ in range(6 * args.concurrency)]
    killed_at = []
    with cluster(checkpoint, args, replicas=2, policy="round_robin") as c:
        urls, victim = [p.url for p in c.servers], c.servers[1].proc

        def on_result(results):
            if not killed_at and sum(r is not None for r in results) >= len(results) // 3:
                victim.send_signal(signal.SIGKILL)
                killed_at.append(time.perf_counter())

        results = asyncio.run(closed_loop(c.router_url, jobs, args.concurrency, "kill", on_result=on_result))
        time.sleep(5)  # a few of the router's health checks
        workers = httpx.get(c.router_url + "/workers", timeout=10).json()["workers"]
        healthy = {w["url"]: w["is_healthy"] for w in workers}
        answers = {}
        for url in urls:  # what each replica's own /metrics says: the killed one does not answer at all
            try:
                answers[url] = httpx.get(url + "/metrics", timeout=2).status_code == 200
            except httpx.TransportError:
                answers[url] = False
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
    "scale": ({"setup": "setup", "tok_s": "output tok/s", "cpu_s": "server CPU s", "tok_per_cpu_s": "tok / CPU s",
               "failed": "failed"}, ("tok_s", "1 replica")),
    "pd": ({"setup": "setup", "tpot_p50_ms": "TPOT p50 ms", "tpot_p99_ms": "TPOT p99 ms",
            "long_prompts": "long prompts sent", "decode_computed": "decode server: prompt tokens computed / request",
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
            results[name] = globals()[name](args, Path(tmp) / "ckpt")
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
