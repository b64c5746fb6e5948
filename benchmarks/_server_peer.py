"""bench_server.py --hf-peer: our server against Hugging Face's `transformers serve --continuous-batching`.

Both serve ONE Hugging Face Llama directory (random weights; 6 layers, d_model 384, GQA, vocab 8192)
written here, with a word-level tokenizer: token i is the word `w<i>`, words split on spaces, so a
prompt of n words is n tokens for both servers and the requests are the same text. The directory names
no end-of-sequence token, so neither server stops early (ours also gets ignore_eos; HF's API refuses
that field). Both run on the CPU with the same thread count, one at a time: a server is started, warmed
up, measured and stopped, alternating ours, HF, ours, HF (the machine is shared; its speed drifts).

Per run: N concurrent non-streamed greedy requests (prompts of min..max words, `--peer-tokens` new
tokens each), output tokens/s = all completion tokens / (first send -> last response). The lone
request's time to first token is measured afterwards, both servers up at once (_ttft_peer.py).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

VOCAB = 8192


def write_hf_llama(path: Path, max_len: int, seed: int = 0) -> None:
    """A random-weight LlamaForCausalLM shaped like the llama-style preset, and a tokenizer it loads offline."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from mini_transformer import TransformerConfig

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece()  # joins the words with spaces
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(path)
    cfg = TransformerConfig.from_preset("llama-style", vocab_size=VOCAB, max_seq_len=max_len)
    hf_cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                         num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=max_len,
                         rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_cfg).eval()
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model.save_pretrained(path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_commands(model_dir: Path, port: int, args) -> dict[str, list[str]]:
    ours = [sys.executable, "-m", "mini_transformer.cli", "serve", "--checkpoint", str(model_dir),
            "--port", str(port), "--model-name", str(model_dir), "--block-size", str(args.block_size),
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--log-level", "warning"]
    hf_cli = Path(sys.executable).with_name("transformers")  # the console script beside this python
    hf = [str(hf_cli), "serve", str(model_dir), "--continuous-batching", "--device", "cpu",
          "--host", "127.0.0.1", "--port", str(port), "--cb-block-size", str(args.block_size),
          "--cb-num-blocks", "4096", "--cb-max-batch-tokens", str(args.max_num_batched_tokens),
          "--log-level", "warning"]
    return {"ours": ours, "hf": hf}


def start(cmd: list[str], port: int, threads: int, log: Path, timeout_s: float = 300):
    """Start a server process; wait (bounded) for /health. Returns (process, url, seconds to ready)."""
    import httpx

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None or time.perf_counter() - began > timeout_s:
            stop(proc)
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"{cmd[0]} {cmd[1]} did not start (exit {proc.returncode}): " + " | ".join(tail))
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - began
        except httpx.TransportError:
            time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def body(name: str, model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    out = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if name == "ours":
        out["ignore_eos"] = True  # HF refuses fields outside OpenAI's schema; its directory has no EOS anyway
    return out


async def saturate(name: str, url: str, model: str, prompts: list[str], max_tokens: int):
    """All requests at once, non-streamed. Returns (output tokens/s, texts)."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        async def one(prompt):
            response = await client.post("/v1/completions", json=body(name, model, prompt, max_tokens, False))
            if response.status_code != 200:
                raise RuntimeError(f"{name}: HTTP {response.status_code} {response.text[:300]}")
            data = response.json()
            return data["usage"]["completion_tokens"], data["choices"][0]["text"]

        began = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - began
    tokens = [n for n, _ in results]
    assert all(n == max_tokens for n in tokens), f"{name}: completion tokens {sorted(set(tokens))}"
    return sum(tokens) / seconds, [text for _, text in results]


def measure_server(name, cmd, port, args, model_dir, prompts, log_dir) -> dict:
    proc, url, ready_s = start(cmd, port, args.threads, log_dir / f"{name}.log")
    model = str(model_dir)
    try:
        warm_began = time.perf_counter()
        asyncio.run(saturate(name, url, model, prompts[:2], 4))  # HF builds its batching manager here
        warm_s = time.perf_counter() - warm_began
        tok_s, texts = asyncio.run(saturate(name, url, model, prompts, args.peer_tokens))
    finally:
        stop(proc)
    return {"tok_s": tok_s, "texts": texts, "ready_s": ready_s, "warm_s": warm_s}


def run_peer(args, log_dir: Path) -> tuple[Path, list[str]]:
    """The saturated runs, alternating; returns the model directory and the servers that ran."""
    rng = random.Random(args.seed)
    prompts = [" ".join(f"w{rng.randrange(VOCAB)}" for _ in range(rng.randint(args.min_len, args.max_len)))
               for _ in range(args.peer_requests)]
    model_dir = log_dir / "llama-6x384-gqa-v8192"
    longest = max(args.max_len, *(int(n) for n in args.ttft_lengths.split(",")))  # _ttft_peer's prompts too
    write_hf_llama(model_dir, max_len=2 * (longest + args.peer_tokens), seed=args.seed)
    names = ["ours", "hf"]
    skipped = None
    try:
        import accelerate  # noqa: F401  `transformers serve` needs it
    except ImportError as err:
        skipped, names = f"accelerate is not installed ({err}); run `uv sync` (dev group)", ["ours"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.pairs):  # ours, HF, ours, HF
        for name in list(names):
            port = free_port()
            try:
                runs[name].append(measure_server(name, server_commands(model_dir, port, args)[name], port, args,
                                                 model_dir, prompts, log_dir))
            except RuntimeError as err:
                if name != "hf":
                    raise
                skipped = str(err)
                names.remove("hf")
                runs.pop("hf", None)
    if args.pairs:
        report(runs, skipped, args)
    elif skipped:
        print(f"\nHF skipped: {skipped}")
    return model_dir, names


def report(runs: dict, skipped: str | None, args) -> None:
    print(f"\nserver peer: {args.peer_requests} concurrent non-streamed requests, prompts of {args.min_len}-"
          f"{args.max_len} tokens, {args.peer_tokens} greedy tokens each; Llama 6x384 GQA vocab 8192 (random "
          f"weights, one HF directory); {args.threads} thread(s) per server; runs alternate ours, HF, ...; "
          f"uptime load {os.getloadavg()[0]:.2f}\n")
    print("| server | output tok/s (each run) | best | ready s / warm-up s |")
    print("|---|---|---:|---:|")
    labels = {"ours": "mini-transformer serve (sdpa)", "hf": "transformers serve --continuous-batching"}
    for name, rs in runs.items():
        each = ", ".join(f"{r['tok_s']:.1f}" for r in rs)
        ready = ", ".join(f"{r['ready_s']:.0f}/{r['warm_s']:.0f}" for r in rs)
        print(f"| {labels[name]} | {each} | {max(r['tok_s'] for r in rs):.1f} | {ready} |")
    if skipped:
        print(f"\nHF row skipped: {skipped}")
        return
    ratios = [o["tok_s"] / h["tok_s"] for o, h in zip(runs["ours"], runs["hf"], strict=True)]
    same = sum(a == b for a, b in zip(runs["ours"][-1]["texts"], runs["hf"][-1]["texts"], strict=True))
    print(f"\nours / HF output tok/s, pair by pair: {', '.join(f'{r:.2f}' for r in ratios)} (target ≥ 2: "
          f"{'met' if min(ratios) >= 2 else 'MISSED'}); greedy texts identical: {same} of "
          f"{len(runs['hf'][-1]['texts'])}")
