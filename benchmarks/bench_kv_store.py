"""Does a shared KV store let a second replica skip a prefix another replica computed? And when does
loading a block beat recomputing it?

Two `mini-transformer serve` replicas, A and B (1 torch thread each), a Llama-style model (GQA, 6
layers, d_model 384, random weights, character vocabulary) and one redis-server of our own. 32 requests
share a 1,024-token prefix and have distinct 64-token tails; the first 16 go to A (all at once), then,
once A has stored its blocks, the other 16 go to B (all at once). Three stores, same run:

  none    no KV store: B computes the prefix again (once; its own prefix cache serves the rest)
  host    --host-kv-bytes on each replica: host memory is per process, so B still computes it
  redis   --kv-store redis://...: B loads the prefix blocks A saved

Reported: B's prompt tokens computed (target with redis <= 1.05 x (tails + one block per request)),
TTFT p50/p90 on B (target on 6x384: redis <= 0.5 x none), bytes moved per loaded token against
2·L·Hkv·D·bytes, and outputs identical across the three. Then the break-even, in this process: the
time to load one block from Redis (MGET, checksum, copy into the pool) against the time to recompute
it (the prefill of the prefix / its blocks), for the served model and smaller ones; loading wins where
the ratio is below 1.

    python benchmarks/bench_kv_store.py                  # a few minutes on 2 cores
    python benchmarks/bench_kv_store.py --requests 8 --prefix 256 --plot kv_store.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM
from mini_transformer.engine import EngineConfig, LLMEngine
from mini_transformer.engine.kv_connector import KVConnector
from mini_transformer.engine.kv_tiers import RedisTier
from mini_transformer.engine.sequence import Sequence
from mini_transformer.tokenizer import CharTokenizer

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?'-\n"
MODES = ("none", "host", "redis")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32, help="requests in all; the first half to A, the rest to B")
    p.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens")
    p.add_argument("--tail", type=int, default=64, help="distinct tail tokens per request")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="PNG", help="TTFT on B and prompt tokens computed, per store")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(n_layer: int, d_model: int, max_seq_len: int, seed: int) -> TransformerLM:
    cfg = TransformerConfig.from_preset("llama-tiny", vocab_size=len(CHARS), d_model=d_model, n_heads=d_model // 64,
                                        n_kv_heads=2, n_layer=n_layer, max_seq_len=max_seq_len, attn_backend="sdpa")
    torch.manual_seed(seed)
    return TransformerLM(cfg).eval()


def start_redis(directory: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", directory], stdout=subprocess.DEVNULL)
    import redis

    client, deadline = redis.Redis(port=port), time.monotonic() + 20
    while True:
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}"
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("redis-server did not start") from None
            time.sleep(0.05)


def start_replica(checkpoint: Path, args, store_flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "mini_transformer.cli", "serve", "--checkpoint", str(checkpoint), "--port", str(port),
           "--model-name", "bench", "--block-size", str(args.block_size), "--max-num-seqs", str(args.requests),
           "--log-level", "warning", *store_flags]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc, url: str) -> None:
    import httpx

    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the replica at {url} did not start")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


def engine_state(url: str) -> dict:
    import httpx

    return httpx.get(url + "/v1/engine/state", timeout=10).json()


def wait_stored(url: str) -> dict:
    """Until the replica holds no request and its writer has sent every block to the tiers (bounded)."""
    deadline = time.monotonic() + 120
    while True:
        state = engine_state(url)
        if not state["running"] and not state["waiting"] and not state["kv_store"].get("pending_saves", 0):
            return state
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} did not drain")
        time.sleep(0.1)


async def one_request(client, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Streamed; returns (TTFT, the output text as character ids)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    sent, ttft, text = time.perf_counter(), None, ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                piece = json.loads(line[6:])["choices"][0]["text"]
                if piece and ttft is None:
                    ttft = time.perf_counter() - sent
                text += piece
    return ttft, [CHARS.index(c) for c in text]


async def burst(url: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[float, list[int]]]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return await asyncio.gather(*(one_request(client, p, max_tokens) for p in prompts))


def run_mode(mode: str, checkpoint: Path, args, redis_url: str, prompts) -> dict:
    flags = {"none": [], "host": ["--host-kv-bytes", str(1 << 30)], "redis": ["--kv-store", redis_url]}[mode]
    import redis

    redis.Redis.from_url(redis_url).flushall()
    (proc_a, url_a), (proc_b, url_b) = start_replica(checkpoint, args, flags), start_replica(checkpoint, args, flags)
    try:
        wait_healthy(proc_a, url_a)
        wait_healthy(proc_b, url_b)
        half = len(prompts) // 2
        out_a = asyncio.run(burst(url_a, prompts[:half], args.max_tokens))
        wait_stored(url_a)
        out_b = asyncio.run(burst(url_b, prompts[half:], args.max_tokens))
        stats_b = wait_stored(url_b)["stats"]
    finally:
        for proc in (proc_a, proc_b):
            proc.terminate()
            proc.wait(timeout=60)
    ttfts = sorted(t for t, _ in out_b)
    return dict(mode=mode, outputs=[o for _, o in out_a + out_b], ttft_p50=statistics.median(ttfts),
                ttft_p90=ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], stats=stats_b)


# ------------------------------------------------------------------------------------ break-even
def load_vs_recompute(model: TransformerLM, redis_url: str, args) -> dict:
    """Per block: recompute = the prefill of the prefix (one request, no store) / its blocks; load = a
    Redis tier's lookup (MGET + checks) and load (copy into the pool) of the same blocks, after a save."""
    bs, prompt = args.block_size, [random.Random(1).randrange(len(CHARS)) for _ in range(args.prefix + 1)]
    blocks = args.prefix // bs
    engine = LLMEngine(model,
                       EngineConfig(block_size=bs, num_blocks=blocks + 8, max_num_batched_tokens=args.prefix + 1),
                       kv_connector=KVConnector([RedisTier(redis_url)]))
    params = SamplingParams(max_tokens=1)
    engine.generate([prompt[:bs + 1]], params, use_tqdm=False)  # warm up
    start = time.perf_counter()
    engine.generate([prompt], params, use_tqdm=False)
    recompute = (time.perf_counter() - start) / blocks
    connector = engine.kv_connector
    connector.flush()
    loads = []
    for _ in range(3):
        seq = Sequence("probe", prompt, params, (), arrival=0, device=torch.device("cpu"))
        start = time.perf_counter()
        found = connector.lookup(seq, 0)
        connector.load(seq, list(range(found)), [0] * found)
        loads.append((time.perf_counter() - start) / max(found, 1))
        assert found == blocks, (found, blocks)
    connector.close()
    cfg = model.config
    return dict(model=f"{cfg.n_layer}x{cfg.d_model}", params_m=sum(p.numel() for p in model.parameters()) / 1e6,
                kv_block_bytes=2 * cfg.n_layer * cfg.n_kv_heads * cfg.d_head * 4 * bs,
                recompute_ms=1e3 * recompute, load_ms=1e3 * min(loads))


def engine_burst(model: TransformerLM, redis_url: str, args, prompts, rounds: int = 2) -> dict:
    """B's burst without HTTP: B's prompts added to a fresh LLMEngine at once, stepped until each has its
    first token; with no store vs with a Redis tier that holds only the prefix (an emptied Redis, then
    one of A's prompts through another engine). Alternating rounds none/redis/none/redis; returns the
    mean TTFT p50 per store."""
    import redis

    half, params = len(prompts) // 2, SamplingParams(max_tokens=1)
    p50s: dict[str, list[float]] = {"none": [], "redis": []}
    loaded, errors = [], 0
    for _ in range(rounds):
        for mode in p50s:
            connector = None
            if mode == "redis":
                redis.Redis.from_url(redis_url).flushall()
                saver = LLMEngine(model, EngineConfig(block_size=args.block_size),
                                  kv_connector=KVConnector([RedisTier(redis_url)]))
                saver.generate(prompts[:1], params, use_tqdm=False)
                saver.kv_connector.close()  # waits for the writer: the prefix is stored
                connector = KVConnector([RedisTier(redis_url)])
            engine = LLMEngine(model, EngineConfig(block_size=args.block_size, max_num_seqs=half),
                               kv_connector=connector)
            start, firsts = time.perf_counter(), []
            for prompt in prompts[half:]:
                engine.add_request(prompt, params)
            while engine.has_unfinished_requests():
                firsts += [time.perf_counter() - start for _ in engine.step()]
            p50s[mode].append(statistics.median(firsts))
            if connector is not None:
                loaded.append(engine.stats()["kv_store_blocks_loaded_redis"])
                errors += engine.stats()["kv_store_store_errors"]
                connector.close()
    return {**{mode: statistics.mean(values) for mode, values in p50s.items()}, "loaded": loaded, "errors": errors}


# --------------------------------------------------------------------------------------- report
def print_report(rows: list[dict], args, model: TransformerLM, even: list[dict], burst: dict) -> None:
    cfg, n_b = model.config, args.requests - args.requests // 2
    formula = 2 * cfg.n_layer * cfg.n_kv_heads * cfg.d_head * 4
    target = n_b * (args.tail + args.block_size)
    none = rows[0]
    print(f"\nB's {n_b} requests ({args.prefix}-token shared prefix + {args.tail}-token tails), "
          f"{cfg.n_layer}x{cfg.d_model} model, block {args.block_size}, load {os.getloadavg()[0]:.2f}")
    print(f"{'store':<6} {'prompt tok computed':>20} {'vs target':>10} {'TTFT p50 s':>11} {'p90 s':>7} "
          f"{'p50 vs none':>12} {'B steps':>8} {'blocks loaded':>14} {'bytes/token':>12} {'wire B/tok':>11} "
          f"{'same out':>9}")
    for r in rows:
        s = r["stats"]
        loaded_tokens = s.get("kv_store_hit_tokens", 0)
        per_token = s.get("kv_store_bytes_loaded", 0) / loaded_tokens if loaded_tokens else float("nan")
        wire = s.get("kv_store_wire_bytes_loaded", 0) / loaded_tokens if loaded_tokens else float("nan")
        loaded = sum(v for k, v in s.items() if k.startswith("kv_store_blocks_loaded_"))
        print(f"{r['mode']:<6} {s['prefill_tokens_computed']:>20} {s['prefill_tokens_computed'] / target:>9.2f}x "
              f"{r['ttft_p50']:>11.3f} {r['ttft_p90']:>7.3f} {r['ttft_p50'] / none['ttft_p50']:>11.2f}x "
              f"{s['steps']:>8} {loaded:>14} {per_token:>12.0f} {wire:>11.0f} "
              f"{str(r['outputs'] == none['outputs']):>9}")
    print(f"target tokens = {n_b} x ({args.tail} + {args.block_size}) = {target}; formula 2·L·Hkv·D·bytes = "
          f"2·{cfg.n_layer}·{cfg.n_kv_heads}·{cfg.d_head}·4 = {formula} bytes per token")
    print(f"\nB's burst in this process, no HTTP (mean of alternating rounds): TTFT p50 none {burst['none']:.3f} s, "
          f"redis {burst['redis']:.3f} s, ratio {burst['redis'] / burst['none']:.2f}x; blocks loaded per round "
          f"{burst['loaded']} (expected {args.prefix // args.block_size}), store errors {burst['errors']}")
    print(f"\nbreak-even (this process, 1 thread, load {os.getloadavg()[0]:.2f}): "
          f"one block of {args.block_size} tokens")
    print(f"{'model':<8} {'params M':>9} {'KV bytes/block':>15} {'recompute ms':>13} {'load ms':>8} "
          f"{'load/recompute':>15}")
    for e in even:
        print(f"{e['model']:<8} {e['params_m']:>9.2f} {e['kv_block_bytes']:>15} {e['recompute_ms']:>13.3f} "
              f"{e['load_ms']:>8.3f} {e['load_ms'] / e['recompute_ms']:>15.3f}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["mode"] for r in rows]
    left.bar(names, [r["stats"]["prefill_tokens_computed"] for r in rows], color="#5fb3f9")
    left.set_title("B: prompt tokens computed")
    right.bar(names, [r["ttft_p50"] for r in rows], color="#f2cc60", label="p50")
    right.scatter(names, [r["ttft_p90"] for r in rows], color="#ff7b72", zorder=3, label="p90")
    right.set_title("B: TTFT (s)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped: the finally blocks stop Redis and the replicas
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    prefix = [rng.randrange(len(CHARS)) for _ in range(args.prefix)]
    prompts = [prefix + [rng.randrange(len(CHARS)) for _ in range(args.tail)] for _ in range(args.requests)]
    max_seq_len = args.prefix + args.tail + args.max_tokens
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(args.n_layer, args.d_model, max_seq_len, args.seed)
        model.save_pretrained(Path(tmp) / "ckpt")
        CharTokenizer(list(CHARS)).save(Path(tmp) / "ckpt")
        redis_proc, redis_url = start_redis(tmp)
        try:
            rows = [run_mode(mode, Path(tmp) / "ckpt", args, redis_url, prompts) for mode in MODES]
            burst = engine_burst(make_model(args.n_layer, args.d_model, max_seq_len, args.seed), redis_url, args,
                                 prompts)
            even = [load_vs_recompute(make_model(n, d, max_seq_len, args.seed), redis_url, args)
                    for n, d in ((2, 128), (4, 256), (args.n_layer, args.d_model))]
        finally:
            redis_proc.terminate()
            redis_proc.wait(timeout=30)
    print_report(rows, args, model, even, burst)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
