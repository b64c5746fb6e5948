"""What does the HTTP server cost, and how does latency grow with load? vLLM's benchmark_serving method.

A Llama-style model (GQA, 6 layers, d_model 384, random weights, character vocabulary) is served by
`mini-transformer serve` in its own process. N requests (token-id prompts and outputs of mixed lengths,
uniform in [min, max], ignore_eos, greedy) arrive as a seeded Poisson process at several rates; every
response is streamed, and from its chunks:

  TTFT  time to first token: send -> first chunk with text
  ITL   inter-token latency: the gaps between successive chunks
  TPOT  time per output token: (e2e - TTFT) / (output tokens - 1)
  e2e   send -> last chunk
  plus requests/s and output tokens/s over the whole run (first send to last token).

Measured in the same run, as references:
  offline   the same workload through an LLMEngine in this process (same settings), all added at once
  lone      requests sent one at a time through the server (no batching): the serial capacity is
            1 / mean lone e2e requests/s; above it, one-request-at-a-time queues without bound
Finite rates are multiples of that serial capacity (--rates); saturation is every request sent at once.
The machine is shared and its speed drifts, so each comparison is between runs close in time: the lone
requests run before and after the finite rates (their mean is the reference), and each saturated server
run comes right after an offline run (--pairs times).

Targets: at saturation, the server's output tokens/s >= 0.8 x offline; at 1.25 x the serial capacity,
p50 TPOT <= 2 x the lone request's.

    python benchmarks/bench_server.py                       # 64 requests per rate (minutes on 2 cores)
    python benchmarks/bench_server.py --requests 16 --max-len 64 --plot server.png
    python benchmarks/bench_server.py --hf-peer --max-len 256   # only: ours vs `transformers serve` (_server_peer.py,
                                                                # lone TTFT and its floor: _ttft_peer.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _common import add_common_args, add_serving_args, apply_common_args, time_call
from tqdm import tqdm

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM
from mini_transformer.engine import EngineConfig, LLMEngine
from mini_transformer.tokenizer import CharTokenizer

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?'-\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serving_args(p, max_len=128, requests_help="requests per rate")
    p.add_argument("--rates", default="0.5,1.25,2.5", help="finite request rates, as multiples of the serial capacity")
    p.add_argument("--pairs", type=int, default=2, help="saturated server runs, each right after an offline run")
    p.add_argument("--lone-requests", type=int, default=8, help="requests sent one at a time for the reference "
                                                                    "(--hf-peer: per server and prompt length)")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    add_common_args(p, threads=1, device=False, plot="latency percentiles vs request rate")  # server and offline
    p.add_argument("--hf-peer", action="store_true",
                   help="only the Hugging Face peer: ours vs `transformers serve --continuous-batching` on one HF "
                        "Llama directory (vocab 8192), --peer-requests at once, alternating --pairs times")
    p.add_argument("--peer-requests", type=int, default=48, help="--hf-peer: concurrent requests per run")
    p.add_argument("--peer-tokens", type=int, default=64, help="--hf-peer: new tokens per request")
    p.add_argument("--ttft-lengths", default="4,16,64,256",
                   help="--hf-peer: prompt lengths (tokens) of the lone requests whose TTFT is compared")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ model and workload
def build_checkpoint(path: Path, args) -> TransformerLM:
    tokenizer = CharTokenizer(list(CHARS))
    cfg = TransformerConfig.from_preset(
        "llama-tiny", vocab_size=tokenizer.vocab_size, d_model=args.d_model, n_heads=args.d_model // 64, n_kv_heads=2,
        n_layer=args.n_layer, max_seq_len=2 * args.max_len, attn_backend="sdpa")
    torch.manual_seed(args.seed)
    model = TransformerLM(cfg).eval()
    model.save_pretrained(path)
    tokenizer.save(path)
    return model


def make_workload(n: int, args, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(len(CHARS)) for _ in range(rng.randint(args.min_len, args.max_len))],
             rng.randint(args.min_len, args.max_len)) for _ in range(n)]


def offline_tokens_per_s(model, workload, args) -> float:
    engine = LLMEngine(model, EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                           max_num_batched_tokens=args.max_num_batched_tokens))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in workload]
    engine.generate([p for p, _ in workload[:2]], params[:2], use_tqdm=False)  # warm up
    outputs, seconds = time_call(lambda: engine.generate([p for p, _ in workload], params, use_tqdm=False))
    return sum(len(o) for o in outputs) / seconds


# ------------------------------------------------------------------------------------ the server
def start_server(checkpoint: Path, args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "mini_transformer.cli", "serve", "--checkpoint", str(checkpoint),
           "--port", str(port), "--model-name", "bench", "--block-size", str(args.block_size),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-waiting", str(4 * args.requests), "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the server did not start")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)


@dataclass
class Result:
    ttft: float = math.nan
    e2e: float = math.nan
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    sent_at: float = 0.0
    done_at: float = 0.0

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


async def one_request(client, prompt: list[int], max_tokens: int) -> Result:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = Result(sent_at=time.perf_counter())
    last = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"request failed: HTTP {response.status_code} {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["text"]:
                continue
            now = time.perf_counter()
            if last is None:
                result.ttft = now - result.sent_at
            else:
                result.itls.append(now - last)
            last = now
    result.done_at = last if last is not None else time.perf_counter()
    result.e2e = result.done_at - result.sent_at
    assert result.output_tokens == max_tokens, (result.output_tokens, max_tokens)
    return result


async def run_rate(url: str, workload, rate: float, seed: int, desc: str) -> list[Result]:
    """Send the workload with exponential gaps of mean 1/rate (Poisson arrivals; inf: all at once)."""
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(workload) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        bar = tqdm(total=len(workload), desc=desc, unit="req", leave=False)

        async def tracked(prompt, max_tokens):
            result = await one_request(client, prompt, max_tokens)
            bar.update(1)
            return result

        tasks = []
        for prompt, max_tokens in workload:
            tasks.append(asyncio.create_task(tracked(prompt, max_tokens)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        bar.close()
    return results


async def run_lone(url: str, workload) -> list[Result]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return [await one_request(client, p, m) for p, m in tqdm(workload, desc="lone", unit="req", leave=False)]


# --------------------------------------------------------------------------------------- summary
def pct(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def summarize(results: list[Result]) -> dict:
    duration = max(r.done_at for r in results) - min(r.sent_at for r in results)
    out = {"req_s": len(results) / duration, "tok_s": sum(r.output_tokens for r in results) / duration}
    for name, values in (("ttft", [r.ttft for r in results]), ("tpot", [r.tpot for r in results]),
                         ("itl", [x for r in results for x in r.itls]), ("e2e", [r.e2e for r in results])):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = pct(values, q) * 1000  # ms
    return out


def print_table(rows: list[tuple[str, dict]], offline: float) -> None:
    print("| rate (req/s) | req/s | output tok/s | × offline | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms "
          "| ITL p50/p90/p99 ms | e2e p50/p90/p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, s in rows:
        trio = {k: "/".join(f"{s[f'{k}_p{q}']:.0f}" for q in (50, 90, 99)) for k in ("ttft", "tpot", "itl", "e2e")}
        print(f"| {label} | {s['req_s']:.2f} | {s['tok_s']:.1f} | {s['tok_s'] / offline:.2f} | {trio['ttft']} "
              f"| {trio['tpot']} | {trio['itl']} | {trio['e2e']} |")


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = dict(rows)
    lone = {k: (table["lone (before)"][k] + table["lone (after)"][k]) / 2 for k in table["lone (before)"]}
    rated = [(label, s) for label, s in rows if not label.startswith("lone")]
    xs = range(len(rated))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        for q, style in ((50, "o-"), (90, "s--"), (99, "^:")):
            ax.plot(xs, [s[f"{metric}_p{q}"] for _, s in rated], style, label=f"p{q}")
        ax.axhline(lone[f"{metric}_p50"], color="grey", lw=1, label="p50 of a lone request")
        ax.set_xticks(list(xs), [label for label, _ in rated], rotation=20)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_yscale("log")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("mini-transformer serve: latency vs request rate (Poisson arrivals)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def measure(args, workload, checkpoint: Path, model) -> tuple[list, list, float, int]:
    """Every measurement, ordered so that each comparison is made between runs close in time (the machine
    is shared and its speed drifts): lone requests before and after the finite rates, and the saturated
    server alternating with the offline engine, `--pairs` times."""
    proc, url = start_server(checkpoint, args)
    rows, pairs = [], []
    try:
        asyncio.run(run_lone(url, make_workload(2, args, args.seed + 99)))  # warm up the server
        lone_workload = make_workload(args.lone_requests, args, args.seed + 1)
        lone = asyncio.run(run_lone(url, lone_workload))
        capacity = 1.0 / statistics.mean(r.e2e for r in lone)
        rows.append(("lone (before)", summarize(lone)))
        for i, factor in enumerate(float(x) for x in args.rates.split(",")):
            rate = factor * capacity
            label = f"{rate:.2f} ({factor:g}× serial)"
            rows.append((label, summarize(asyncio.run(run_rate(url, workload, rate, args.seed + 10 + i, label)))))
        rows.append(("lone (after)", summarize(asyncio.run(run_lone(url, lone_workload)))))
        for k in range(args.pairs):
            offline = offline_tokens_per_s(model, workload, args)  # the server idles meanwhile
            saturated = summarize(asyncio.run(run_rate(url, workload, math.inf, args.seed, "inf")))
            rows.append((f"inf (all at once) #{k + 1}", saturated))
            pairs.append((offline, saturated["tok_s"]))
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    return rows, pairs, capacity, code


def main(argv=None) -> None:
    args = parse_args(argv)
    apply_common_args(args)
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average) on {os.cpu_count()} cores")
    if args.hf_peer:
        from _server_peer import run_peer
        from _ttft_peer import run_lone_ttft

        with tempfile.TemporaryDirectory() as tmp:
            model_dir, names = run_peer(args, Path(tmp))  # saturated: ours, HF, ours, HF
            run_lone_ttft(model_dir, names, args, Path(tmp))  # then lone requests, both servers up
        return
    workload = make_workload(args.requests, args, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint(Path(tmp), args)
        rows, pairs, capacity, code = measure(args, workload, Path(tmp), model)
    offline = statistics.mean(o for o, _ in pairs)
    print(f"\nserial capacity {capacity:.3f} req/s; server exit status {code}; "
          f"load after: {os.getloadavg()[0]:.2f}; offline engine, same workload: "
          f"{', '.join(f'{o:.1f}' for o, _ in pairs)} output tok/s (the × offline column uses their mean)\n")
    print_table(rows, offline)
    ratios = [s / o for o, s in pairs]
    print(f"\nsaturation, each server run / the offline run just before it: "
          f"{', '.join(f'{r:.2f}' for r in ratios)} (target ≥ 0.8): {'met' if min(ratios) >= 0.8 else 'MISSED'}")
    table = dict(rows)
    lone_tpot = statistics.mean(table[k]["tpot_p50"] for k in ("lone (before)", "lone (after)"))
    near = next((s for label, s in rows if "(1.25× serial)" in label), None)
    if near is not None:
        ratio = near["tpot_p50"] / lone_tpot
        print(f"at 1.25× serial capacity: p50 TPOT {near['tpot_p50']:.1f} ms = {ratio:.2f}× a lone request's "
              f"{lone_tpot:.1f} ms (mean of before and after; target ≤ 2): {'met' if ratio <= 2 else 'MISSED'}")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
