"""bench_server.py --hf-peer, lone TTFT: where a lone request's time to first token goes, ours and HF's.

Both servers run at once (an idle server waits without using the CPU) and get one streamed request at a
time over a kept-open connection, alternating request by request (ours, HF, then HF, ours, ...), so the
shared machine's drift falls on both alike. Every request has a fresh prompt of random words that no
server has seen (both have prefix caching: a prompt seen before would skip most of its prefill),
`max_tokens` 8, and TTFT = send -> first chunk with text, as bench_server.py measures it.

Beside each pair of requests, in this process, the floor: one bare forward pass of each model over a
fresh prompt of the same length, our TransformerLM and HF's LlamaForCausalLM loaded from the same
directory, logits at the last position only (as both servers compute), alternating too, so the floor
sees the same drift as the requests. A server's TTFT minus its model's forward is what HTTP, the queues,
the engine step's bookkeeping, the first chunk, and a step that runs slower in a server than back to back
here (weights gone cold from the cache while the server idled, two threads of the server sharing the
GIL) add; the forward is the part no server can skip, so `our forward / HF's TTFT` is about the best
ratio our server could reach with this model code.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

from _server_peer import VOCAB, body, free_port, saturate, server_commands, start, stop

NEW_TOKENS = 8  # per lone request: the first chunk is what is timed


def fresh_prompt(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(VOCAB)}" for _ in range(n))


async def first_chunk_s(client, name: str, model: str, prompt: str) -> float:
    """Seconds from sending one streamed request to its first chunk with text."""
    began, first = time.perf_counter(), None
    async with client.stream("POST", "/v1/completions", json=body(name, model, prompt, NEW_TOKENS, True)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{name}: HTTP {r.status_code} {await r.aread()}")
        async for line in r.aiter_lines():  # read to the end: the next request finds the server idle
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text"):
                    first = time.perf_counter() - began
    if first is None:
        raise RuntimeError(f"{name}: the stream had no text")
    return first


def bare_forwards(model_dir: Path, names: list[str]) -> dict:
    """{name: forward(ids) -> None}: our model and (when it runs) HF's, loaded in this process."""
    import torch
    from transformers import LlamaForCausalLM

    from mini_transformer.model.transformer import TransformerLM

    ours = TransformerLM.from_pretrained(model_dir).eval()
    models = {"ours": lambda x: ours.logits(x, logits_at=torch.tensor([x.shape[1] - 1]))}
    if "hf" in names:
        hf = LlamaForCausalLM.from_pretrained(model_dir).eval()
        models["hf"] = lambda x: hf(x, logits_to_keep=1, use_cache=False)
    return models


def time_forward(forward, n: int, rng: random.Random) -> float:
    """ms of one bare forward over a fresh prompt of n tokens."""
    import torch

    x = torch.tensor([[rng.randrange(VOCAB) for _ in range(n)]])
    with torch.inference_mode():
        began = time.perf_counter()
        forward(x)
        return 1000 * (time.perf_counter() - began)


async def measure(urls: dict[str, str], forwards: dict, model: str, lengths: list[int], reps: int,
                  rng: random.Random) -> tuple[dict, dict]:
    """({(server, length): [TTFT ms]}, {(model, length): [forward ms]}): per repetition and length, one
    request to each server, then one forward of each model; the order alternates. Each server keeps one
    connection open, as an OpenAI client does (a new TCP connection per request costs 1-6 ms here)."""
    import httpx

    ttft = {(name, n): [] for name in urls for n in lengths}
    floor = {(name, n): [] for name in forwards for n in lengths}
    clients = {name: httpx.AsyncClient(base_url=url, timeout=300) for name, url in urls.items()}
    try:
        for name, client in clients.items():  # open the connections
            await first_chunk_s(client, name, model, fresh_prompt(rng, 4))
        for forward in forwards.values():  # warm up: the first calls allocate
            time_forward(forward, max(lengths), rng)
        for i in range(reps):
            for j, n in enumerate(lengths):
                flip = (i + j) % 2 == 1
                for name in list(urls)[::-1] if flip else list(urls):
                    ttft[name, n].append(1000 * await first_chunk_s(clients[name], name, model, fresh_prompt(rng, n)))
                for name in list(forwards)[::-1] if flip else list(forwards):
                    floor[name, n].append(time_forward(forwards[name], n, rng))
    finally:
        for client in clients.values():
            await client.aclose()
    return ttft, floor


def run_lone_ttft(model_dir: Path, names: list[str], args, log_dir: Path) -> None:
    lengths = [int(x) for x in args.ttft_lengths.split(",")]
    rng = random.Random(args.seed + 7)
    forwards = bare_forwards(model_dir, names)
    load_before = os.getloadavg()[0]
    servers, urls = [], {}
    try:
        for name in names:  # both up at once; each warmed up like the saturated runs
            port = free_port()
            proc, url, _ = start(server_commands(model_dir, port, args)[name], port, args.threads,
                                 log_dir / f"{name}-ttft.log")
            servers.append(proc)
            asyncio.run(saturate(name, url, str(model_dir), [fresh_prompt(rng, 8), fresh_prompt(rng, 9)], 4))
            urls[name] = url
        ttft, floor = asyncio.run(measure(urls, forwards, str(model_dir), lengths, args.lone_requests, rng))
    finally:
        for proc in servers:
            stop(proc)
    report(ttft, floor, names, lengths, args, load_before)


def report(ttft: dict, floor: dict, names: list[str], lengths: list[int], args, load_before: float) -> None:
    med = {key: statistics.median(values) for key, values in {**{("ttft",) + k: v for k, v in ttft.items()},
                                                              **{("fwd",) + k: v for k, v in floor.items()}}.items()}
    print(f"\nlone TTFT: {args.lone_requests} streamed requests per server and prompt length, one at a time, "
          f"alternating ours/HF request by request, one kept-open connection each, fresh prompts (no prefix-cache "
          f"hit), {NEW_TOKENS} new tokens; "
          f"forward = one bare forward of the model in this process ({args.threads} thread(s)), beside each "
          f"pair of requests; medians; "
          f"uptime load {load_before:.2f} before, {os.getloadavg()[0]:.2f} after\n")
    if "hf" not in names:
        print("| prompt tokens | ours TTFT ms | our forward ms | TTFT − forward ms |\n|---:|---:|---:|---:|")
        for n in lengths:
            o, f = med["ttft", "ours", n], med["fwd", "ours", n]
            print(f"| {n} | {o:.1f} | {f:.1f} | {o - f:.1f} |")
        return
    print("| prompt tokens | ours TTFT ms | HF TTFT ms | ours / HF | our forward ms | HF forward ms "
          "| ours − forward ms | HF − forward ms | floor: our forward / HF TTFT |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for n in lengths:
        o, h, fo, fh = med["ttft", "ours", n], med["ttft", "hf", n], med["fwd", "ours", n], med["fwd", "hf", n]
        ratios.append(o / h)
        print(f"| {n} | {o:.1f} | {h:.1f} | {o / h:.2f} | {fo:.1f} | {fh:.1f} | {o - fo:.1f} | {h - fh:.1f} "
              f"| {fo / h:.2f} |")
    print(f"\nlone TTFT ours / HF per prompt length: {', '.join(f'{r:.2f}' for r in ratios)} (target ≤ 0.4: "
          f"{'met' if max(ratios) <= 0.4 else 'MISSED'})")
