"""What does structured output cost the engine? (`bench_serving.py --structured`, or run this file.)

The engine workload of bench_serving.py (a Llama-style random-weight model, N requests of prompt and output
lengths uniform in [min, max]) over a byte-level BPE vocabulary trained on JSON-like text, three ways,
alternating A B C A B C in one run:

  unconstrained    every request free (ignore_eos): the reference
  structured       every other request constrained by a JSON schema (an array of objects with an integer,
                   a short string, an enum and a boolean; minItems high enough that the grammar never lets
                   it end inside max_tokens, so every request runs its full length, as the free ones do)
  serial mask      the same, but each mask is filled after the forward instead of during it (overlap off)

Reported: output tokens/s and the ratio to unconstrained (target >= 0.8x; on a shared CPU the runs of one
configuration spread by tens of percent, so the last column is the steadier answer), and per masked step the time
xgrammar spent filling the mask (on the worker thread when overlapped), the time the sampler waited for it
(the part the forward did not hide; all of the fill when serial), the time applying it to the logits, and
what the mask adds to a step's critical path (wait + apply) as a share of the step's time in the same run.
The free rows' tokens are checked to equal the unconstrained run's (greedy), and every request to have run
its full length (the grammar accepted every token: a refused one would end the request early).

    python benchmarks/bench_structured.py --quick
    python benchmarks/bench_serving.py --structured --quick
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
from _common import add_common_args, add_serving_args

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM
from mini_transformer.engine import EngineConfig, LLMEngine
from mini_transformer.inference.structured import StructuredOutput
from mini_transformer.tokenizer import BPETokenizer

ITEM = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99999}, "name": {"type": "string", "maxLength": 12},
    "tag": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}, "required": ["id", "name", "tag", "ok"]}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 500}
WORDS = "alpha beta gamma delta red green blue true false null id name tag ok item list value".split()


def corpus(rng: random.Random, n: int = 3000) -> str:
    """JSON-like text for the BPE vocabulary: records of words and numbers."""
    records = [{"id": rng.randrange(10**6), "name": " ".join(rng.choices(WORDS, k=2)), "tag": rng.choice(WORDS),
                "ok": rng.random() < 0.5, "n": [rng.randrange(100) for _ in range(3)]} for _ in range(n)]
    return "\n".join(json.dumps(r) for r in records)


def build(args):
    rng = random.Random(args.seed)
    tokenizer = BPETokenizer.train(corpus(rng), args.structured_vocab)
    max_seq_len = 2 * args.max_len
    cfg = TransformerConfig.from_preset("llama-style", max_seq_len=max_seq_len, vocab_size=tokenizer.vocab_size)
    torch.manual_seed(args.seed)
    return TransformerLM(cfg).to(args.device).eval(), tokenizer


def run(model, tokenizer, prompts, params, args, overlap=True):
    config = EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    engine = LLMEngine(model, config, eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer)
    engine.runner.sampler.grammar.overlap = overlap
    for p in params:  # compile before the clock starts (a server compiles at the door, once per schema)
        if p.structured is not None:
            engine.structured_output.compile(p.structured)
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    outputs = {i: [] for i in ids}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    seconds = time.perf_counter() - start
    return [outputs[i] for i in ids], seconds, dict(engine.runner.sampler.grammar.timings), engine.stats()["steps"]


def structured_workload(args) -> None:
    torch.set_num_threads(args.threads)
    model, tokenizer = build(args)
    rng = random.Random(args.seed)
    vocab = tokenizer.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.requests)]
    out_lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.requests)]
    free = [SamplingParams(max_tokens=n, ignore_eos=True) for n in out_lens]
    constraint = StructuredOutput(json_schema=SCHEMA)
    mixed = [SamplingParams(max_tokens=n, structured=constraint) if i % 2 else free[i] for i, n in enumerate(out_lens)]
    ways = {"unconstrained": (free, True), "structured (mask during the forward)": (mixed, True),
            "structured, serial mask (after the forward)": (mixed, False)}
    results = {name: [] for name in ways}
    with torch.inference_mode():
        run(model, tokenizer, prompts[:2], mixed[:2], args)  # warm-up: xgrammar's import and first kernels
        for _ in range(args.rounds):
            for name, (params, overlap) in ways.items():
                results[name].append(run(model, tokenizer, prompts, params, args, overlap))
    n_tokens = sum(out_lens)
    best = {name: min(runs, key=lambda r: r[1]) for name, runs in results.items()}
    base = best["unconstrained"][1]
    print(f"\nstructured workload: {args.requests} requests, lengths uniform in [{args.min_len}, {args.max_len}], "
          f"{n_tokens} output tokens, greedy, half constrained by a JSON schema; BPE vocabulary of {vocab}; "
          f"{args.rounds} alternating runs each, best shown; {args.threads} torch thread(s); "
          f"uptime load {os.getloadavg()[0]:.2f}\n")
    print("| engine | seconds (each run) | output tok/s | × unconstrained | masked steps | fill ms/step "
          "| wait ms/step | apply ms/step | share of the fill hidden by the forward | mask on the step's path "
          "(wait + apply) / step time |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        _, secs, timing, steps_run = best[name]
        steps = max(timing["steps"], 1)
        overlap = ways[name][1]
        hidden = "0% (serial)" if not overlap else (
            f"{100 * max(0.0, 1 - timing['wait'] / timing['fill']):.0f}%" if timing["fill"] else "-")
        on_path = (timing["wait"] + timing["apply"]) / steps
        cells = "| - | - | - | - | -" if not timing["steps"] else (
            f"| {1000 * timing['fill'] / steps:.3f} | {1000 * timing['wait'] / steps:.3f} | "
            f"{1000 * timing['apply'] / steps:.3f} | {hidden} | "
            f"{1000 * on_path:.2f} of {1000 * secs / steps_run:.1f} ms ({100 * on_path * steps_run / secs:.1f}%)")
        print(f"| {name} | {', '.join(f'{r[1]:.1f}' for r in runs)} | {n_tokens / secs:.1f} | {base / secs:.2f}× | "
              f"{timing['steps']} {cells} |")
    free_out = best["unconstrained"][0]
    for name in list(ways)[1:]:
        outs = best[name][0]
        same = all(outs[i] == free_out[i] for i in range(0, args.requests, 2))
        full = all(len(outs[i]) == out_lens[i] for i in range(args.requests))
        print(f"\n{name}: free rows equal to the unconstrained run: {same}; every request ran its full length: {full}")
    sample = tokenizer.decode(best["structured (mask during the forward)"][0][1][:40])
    print(f"a constrained output begins: {sample!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--structured-vocab", type=int, default=2048, help="BPE vocabulary size for --structured")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serving_args(p, max_len=256)
    add_common_args(p, threads=1, plot=None)  # 1 thread: a busy machine
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="16 requests of 16-64 tokens")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.max_len = 16, 64
    structured_workload(args)


if __name__ == "__main__":
    main()
