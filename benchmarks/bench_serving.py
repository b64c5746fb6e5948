"""What does the serving engine buy? Output tokens/s, forward passes and KV memory, three ways, one run.

nano-vllm's bench.py, sized for a small CPU: a Llama-style model (GQA, 6 layers, d_model 384, random
weights), N requests whose prompt and output lengths are uniform in [16, 256], ignore_eos, greedy.

  one-at-a-time  generate() on each request alone (a KV cache sized to the request)
  static         generate() on left-padded batches of 8 in arrival order: a batch runs until its longest
                 output is done, and its cache is (8, longest prompt + longest output) from the start
  engine         LLMEngine: every request added at once; continuous batching over a paged pool

KV memory: the share of reserved KV slots that hold no real token, averaged over the decode steps
(static: the slab; engine: the blocks in use). Then a prefix workload: 32 requests sharing one 256-token
prefix with different 16-token suffixes, all added at once: prompt tokens computed with prefix caching
on vs off, and time to first token of one more request with the prefix cached (warm) vs not (cold).

    python benchmarks/bench_serving.py                              # the full run (minutes on 2 cores)
    python benchmarks/bench_serving.py --quick                      # a quick look (16 requests of 16-64 tokens)
    python benchmarks/bench_serving.py --plot pool.png              # the block pool over time
    python benchmarks/bench_serving.py --sampled                    # + sampled vs greedy engine, profiled
    python benchmarks/bench_serving.py --preset llama-tiny --ways engine --sampled   # host share, small model

--structured adds the structured-output workload of bench_structured.py: half the requests
JSON-schema constrained vs none, the mask's cost per step and whether the forward hides it.

--sampled adds a sampled workload: the same requests through the engine greedy and sampled
(temperature 0.8, top-p 0.95, every other request with repetition penalty 1.1), alternating greedy,
sampled, greedy, sampled; the table gives the sampled/greedy tokens/s ratio, then a torch.profiler table
of a few sampled decode steps with the share of time inside the batched sampler (engine/sampler.py).

Every engine row also gives the host share of a step = 1 - (time inside the model's forward / time
inside engine.step()), over all steps and over the full steps (every running sequence made a token):
what scheduling, building inputs, sampling and outputs cost beside the model. The compiled CPU decode
attention is compiled before anything is timed (the server's warm-up, server/run.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time

import torch
from _common import add_common_args, add_serving_args, apply_common_args, time_call, time_interleaved
from _cpu_peers import check_peers, cpu_peer_workload
from _generate_batch_peer import ForwardTimer, hf_peer_workload, warm_up
from bench_structured import add_arguments as add_structured_arguments  # a sibling file: benchmarks/ is on sys.path
from bench_structured import structured_workload
from tqdm import tqdm

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM, generate
from mini_transformer.engine import EngineConfig, LLMEngine


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                conflict_handler="resolve")  # --threads: redefined below to take a list
    add_serving_args(p, max_len=256)
    p.add_argument("--static-batch", type=int, default=8)
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--prefix-output", type=int, default=16, help="tokens generated per prefix request")
    p.add_argument("--ways", nargs="+", default=["one-at-a-time", "static", "engine"],
                   choices=["one-at-a-time", "static", "engine"], help="engine is always run")
    p.add_argument("--seed", type=int, default=0)
    add_common_args(p, threads=1, plot="draw the block pool over time to this PNG")  # 1 thread: a busy machine
    p.add_argument("--threads", type=int, nargs="+", default=[1],
                   help="torch CPU threads (one value; the CPU-peer runs take several, a table row each)")
    p.add_argument("--sampled", action="store_true", help="also: sampled vs greedy engine tokens/s, and a profile")
    p.add_argument("--structured", action="store_true",
                   help="also: half the requests JSON-schema constrained vs none (bench_structured.py)")
    add_structured_arguments(p)
    p.add_argument("--vocab-size", type=int, help="the model's vocabulary (default: the preset's)")
    p.add_argument("--preset", default="llama-style", choices=["llama-style", "llama-tiny"],
                   help="the model's shape (llama-tiny: 2 x 64, where the host's share of a step is largest)")
    p.add_argument("--rounds", type=int, default=2, help="--sampled: greedy/sampled runs, alternating")
    p.add_argument("--new-tokens", type=int, help="tokens each request generates (default: uniform in "
                   "[--min-len, --max-len])")
    p.add_argument("--hf-peer", action="store_true",
                   help="only the Hugging Face continuous-batching comparison: a Llama of vocab 8192, "
                        "48 prompts of 16-256 tokens, 64 greedy tokens each, ours vs model.generate_batch, "
                        "alternating, with the host share of our steps")
    p.add_argument("--profile", action="store_true", help="--hf-peer: also profile one engine run (torch.profiler)")
    p.add_argument("--vllm-peer", nargs="?", const="", metavar="PYTHON",
                   help="only the CPU-peer comparison (_cpu_peers.py), with vLLM's CPU build: a Python that "
                        "imports vllm (default $VLLM_VENV/bin/python)")
    p.add_argument("--llama-server-peer", nargs="?", const="", metavar="BINARY",
                   help="only the CPU-peer comparison, with llama.cpp's llama-server (default $LLAMA_SERVER, "
                        "or on PATH)")
    p.add_argument("--model", default="small", choices=["small", "125m"],
                   help="CPU peers: Llama 6x384 vocab 8192 (48 requests) or the 125M Llama (16 requests)")
    p.add_argument("--peer-rounds", type=int, default=3, help="CPU peers: timed rounds per system, alternating")
    p.add_argument("--quick", action="store_true",
                   help="a small run (16 requests of 16-64 tokens, 8 prefix requests on a 64-token prefix)")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.max_len, args.prefix_requests, args.prefix_len = 16, 64, 8, 64
    args.cpu_peers = args.vllm_peer is not None or args.llama_server_peer is not None
    if not args.cpu_peers:
        if len(args.threads) != 1:
            p.error("--threads takes several values only with --vllm-peer / --llama-server-peer")
        args.threads = args.threads[0]
    return args


def build_model(args) -> TransformerLM:
    vocab = {} if args.vocab_size is None else dict(vocab_size=args.vocab_size)
    max_seq_len = max(2 * args.max_len, args.prefix_len + args.suffix_len + args.prefix_output)
    cfg = TransformerConfig.from_preset(args.preset, max_seq_len=max_seq_len, **vocab)
    torch.manual_seed(args.seed)
    return TransformerLM(cfg).to(args.device).eval()


class ForwardCounter:
    """Forward passes of the model: the LM head runs once per pass (the engine and generate() call
    model.logits, which the root module's own hooks do not see)."""

    def __init__(self, model):
        self.calls = 0
        model.lm_head.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def one_at_a_time(model, prompts, out_lens, device):
    outputs, reserved, empty = [], 0, 0.0
    for prompt, n in tqdm(list(zip(prompts, out_lens, strict=True)), desc="one-at-a-time", unit="req"):
        idx = torch.tensor([prompt], device=device)
        outputs.append(generate(model, idx, SamplingParams(max_tokens=n, ignore_eos=True))[0].tolist())
        slots = len(prompt) + n  # generate sizes the cache to the request
        for t in range(n):  # after step t the cache holds len(prompt) + t tokens
            reserved += slots
            empty += slots - (len(prompt) + t)
    return outputs, empty / reserved


def static_batches(model, prompts, out_lens, batch_size, device):
    outputs, reserved, empty = [], 0, 0.0
    for start in tqdm(range(0, len(prompts), batch_size), desc="static", unit="batch"):
        batch, lens = prompts[start:start + batch_size], out_lens[start:start + batch_size]
        width, n = max(map(len, batch)), max(lens)
        idx = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, prompt in enumerate(batch):  # left padding
            idx[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        new = generate(model, idx.to(device), SamplingParams(max_tokens=n, ignore_eos=True),
                       attention_mask=mask.to(device))
        outputs += [new[row, :lens[row]].tolist() for row in range(len(batch))]
        slots = len(batch) * (width + n)
        for t in range(n):  # tokens a row makes past its own length are waste too
            reserved += slots
            empty += slots - sum(len(p) + min(t, m - 1) for p, m in zip(batch, lens, strict=True))
    return outputs, empty / reserved


def run_engine(model, prompts, params, args, *, caching=True, desc="engine"):
    """All requests added at once, stepped to the end. Returns outputs, the per-step pool record, stats
    (with host_share: 1 - the model's forward time / the time inside engine.step(), over all steps)."""
    engine = LLMEngine(model, EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                           max_num_batched_tokens=args.max_num_batched_tokens,
                                           enable_prefix_caching=caching))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    outputs = {i: [] for i in ids}
    record = []  # (seconds, blocks in use, shared blocks, kv bytes in use, kv bytes holding a token)
    timer = ForwardTimer.of(model)
    step_s = forward_s = 0.0
    start = time.perf_counter()
    with tqdm(total=sum(sp.max_tokens for sp in params), desc=desc, unit="tok") as bar:
        while engine.has_unfinished_requests():
            forward_before, step_start = timer.seconds, time.perf_counter()
            outs = engine.step()
            seconds, forward = time.perf_counter() - step_start, timer.seconds - forward_before
            step_s, forward_s = step_s + seconds, forward_s + forward
            for out in outs:
                outputs[out.request_id] += out.new_token_ids
                bar.update(len(out.new_token_ids))
            s = engine.stats()
            record.append((time.perf_counter() - start, s["blocks_in_use"], s["shared_blocks"],
                           s["kv_bytes_in_use"], s["kv_bytes_holding_tokens"]))
    stats = engine.stats()
    stats["host_share"] = 1 - forward_s / step_s
    return [outputs[i] for i in ids], record, stats


def main_workload(model, args, counter):
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.requests)]
    out_lens = [args.new_tokens or rng.randint(args.min_len, args.max_len) for _ in range(args.requests)]
    n_tokens = sum(out_lens)
    rows, reference = [], None
    if "one-at-a-time" in args.ways:
        counter.calls = 0
        (reference, waste), seconds = time_call(lambda: one_at_a_time(model, prompts, out_lens, args.device))
        rows.append(["one-at-a-time", seconds, counter.calls, waste])
    if "static" in args.ways:
        counter.calls = 0
        (static_out, waste), seconds = time_call(
            lambda: static_batches(model, prompts, out_lens, args.static_batch, args.device))
        rows.append([f"static batches of {args.static_batch}", seconds, counter.calls, waste])
        reference = reference or static_out
    counter.calls = 0
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in out_lens]
    (outputs, record, stats), seconds = time_call(lambda: run_engine(model, prompts, params, args))
    in_use = sum(r[3] for r in record)
    rows.append(["engine", seconds, counter.calls, 1 - sum(r[4] for r in record) / in_use if in_use else 0.0])
    base = rows[0][1]
    print(f"\n{args.requests} requests, prompt and output lengths uniform in [{args.min_len}, {args.max_len}], "
          f"{n_tokens} output tokens, ignore_eos, greedy; uptime load {os.getloadavg()[0]:.2f}\n")
    print("| way | seconds | output tok/s | × first row | forward passes | KV slots reserved holding no token |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, secs, forwards, waste in rows:
        print(f"| {name} | {secs:.1f} | {n_tokens / secs:.1f} | {base / secs:.2f}× | {forwards} | {100 * waste:.1f}% |")
    if reference is not None:
        same = sum(a == b for a, b in zip(reference, outputs, strict=True))
        print(f"\nengine outputs equal to generate()'s: {same} of {args.requests} requests")
    print(f"engine: {stats['steps']} steps, {stats['mixed_steps']} mixed prefill+decode, peak "
          f"{stats['peak_blocks_in_use']} of {stats['num_blocks']} blocks, {stats['preemptions']} preemptions")
    print(host_share_line("greedy", stats))
    return record


def host_share_line(name: str, stats: dict) -> str:
    return f"host share of a step ({name}, whole run): {stats['host_share']:.1%}"


def steady_host_shares(model, prompts, ways: dict, args, steps: int = 32, rounds: int = 5) -> dict:
    """Host share of decode steps with every request running, per way (name -> per-request params): all
    prompts prefilled first (each request asks for all the room its context has left, to outlast the
    timed steps), then `steps` steps of each way in turn, `rounds` times (A B A B: the machine's load
    falls on both alike). Returns name -> (running sequences, median share, median ms per step)."""
    n = min(len(prompts), args.max_num_seqs)
    engines = {}
    for name, params in ways.items():
        engine = LLMEngine(model, EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                               max_num_batched_tokens=args.max_num_batched_tokens))
        for prompt, p in zip(prompts[:n], params[:n], strict=True):
            engine.add_request(prompt, dataclasses.replace(p, max_tokens=model.config.max_seq_len - len(prompt)))
        while engine.stats()["prefill_tokens_computed"] < sum(map(len, prompts[:n])):
            engine.step()
        engines[name] = engine
    timer = ForwardTimer.of(model)
    shares, ms = {name: [] for name in ways}, {name: [] for name in ways}
    for _ in range(rounds):
        for name, engine in engines.items():
            timer.seconds, start = 0.0, time.perf_counter()
            for _ in range(steps):
                assert len(engine.step()) == n, "every sequence makes a token in every timed step"
            seconds = time.perf_counter() - start
            shares[name].append(1 - timer.seconds / seconds)
            ms[name].append(1000 * seconds / steps)
    return {name: (n, statistics.median(shares[name]), statistics.median(ms[name])) for name in ways}


def sampled_params(out_lens):
    """Temperature 0.8, top-p 0.95; every other request also repetition penalty 1.1."""
    return [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, top_p=0.95,
                           repetition_penalty=1.1 if i % 2 else None) for i, n in enumerate(out_lens)]


def sampled_workload(model, args):
    """The engine on the main workload's requests, greedy vs sampled, alternating; then a profile."""
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.requests)]
    out_lens = [args.new_tokens or rng.randint(args.min_len, args.max_len) for _ in range(args.requests)]
    ways = {"greedy": [SamplingParams(max_tokens=n, ignore_eos=True) for n in out_lens],
            "sampled": sampled_params(out_lens)}
    last_stats = {}

    def run(name):
        last_stats[name] = run_engine(model, prompts, ways[name], args, desc=name)[2]

    runs = {name: (lambda n=name: run(n)) for name in ways}
    timings = time_interleaved(runs, repeats=args.rounds, warmup=0, device=args.device, grad="grad")
    n_tokens = sum(out_lens)
    greedy = timings["greedy"].median
    print(f"\nsampled workload: {args.requests} requests, {n_tokens} output tokens; sampled = temperature 0.8, "
          f"top-p 0.95, half with repetition penalty 1.1; {args.rounds} alternating runs each, median shown; "
          f"uptime load {os.getloadavg()[0]:.2f}\n")
    print("| engine | seconds (each run) | output tok/s (median) | × greedy |")
    print("|---|---|---:|---:|")
    for name, timing in timings.items():
        each = ", ".join(f"{t:.1f}" for t in timing.times)
        print(f"| {name} | {each} | {n_tokens / timing.median:.1f} | {greedy / timing.median:.2f}× |")
    print()
    steady = steady_host_shares(model, prompts, ways, args)
    print(f"host share of a step = 1 - forward time / step time; decode steps with all running: 5 rounds of "
          f"32 steps per engine, alternating, median shown; uptime load {os.getloadavg()[0]:.2f}\n")
    print("| engine | host share, whole run (last) | running sequences | host share, decode steps with all "
          "running | ms per such step |")
    print("|---|---:|---:|---:|---:|")
    for name, stats in last_stats.items():
        n, share, ms = steady[name]
        print(f"| {name} | {stats['host_share']:.1%} | {n} | {share:.1%} | {ms:.2f} |")
    profile_sampled_steps(model, prompts, ways["sampled"], args)


def profile_sampled_steps(model, prompts, params, args, steps=8):
    """torch.profiler over a few decode steps of a full batch of sampled requests: the sampler's share."""
    from torch.profiler import ProfilerActivity, profile, record_function

    engine = LLMEngine(model, EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                           max_num_batched_tokens=args.max_num_batched_tokens))
    sampler = engine.runner.sampler
    plain_sample = sampler.sample

    def sample(*a, **kw):
        with record_function("batched sampler"):
            return plain_sample(*a, **kw)

    sampler.sample = sample
    n = min(len(prompts), args.max_num_seqs)
    for prompt, p in zip(prompts[:n], params[:n], strict=True):
        engine.add_request(prompt, dataclasses.replace(p, max_tokens=max(p.max_tokens, 2 * steps)))
    while engine.stats()["prefill_tokens_computed"] < sum(map(len, prompts[:n])):
        engine.step()  # every prompt in: the profiled steps are decode steps of n sequences
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("engine step"):
        for _ in range(steps):
            engine.step()
    events = {e.key: e for e in prof.key_averages()}
    total, sampler_time = events["engine step"].cpu_time_total, events["batched sampler"].cpu_time_total
    print(f"\nprofile of {steps} decode steps of {n} sampled sequences: the batched sampler is "
          f"{100 * sampler_time / total:.1f}% of the step time ({sampler_time / steps / 1000:.2f} ms of "
          f"{total / steps / 1000:.2f} ms per step); top ops by self CPU time:\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def ttft(model, args, prompt, caching: bool, warm_prompt=None) -> float:
    """Seconds from add_request to the first token of `prompt`, after `warm_prompt` was served (if any)."""
    engine = LLMEngine(model, EngineConfig(block_size=args.block_size,
                                           max_num_batched_tokens=args.max_num_batched_tokens,
                                           enable_prefix_caching=caching))
    if warm_prompt is not None:
        engine.generate([warm_prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    while not engine.step():
        pass
    return time.perf_counter() - start


def prefix_workload(model, args):
    rng = random.Random(args.seed + 1)
    vocab = model.config.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(vocab) for _ in range(args.suffix_len)] for _ in range(args.prefix_requests + 1)]
    params = [SamplingParams(max_tokens=args.prefix_output, ignore_eos=True)] * args.prefix_requests
    results = {}
    for caching in (True, False):
        outputs, record, stats = run_engine(model, prompts[:-1], params, args, caching=caching,
                                            desc=f"prefix, caching {'on' if caching else 'off'}")
        results[caching] = (outputs, record, stats)
    cold = statistics.median(ttft(model, args, prompts[-1], False) for _ in range(3))
    warm = statistics.median(ttft(model, args, prompts[-1], True, warm_prompt=prompts[0]) for _ in range(3))
    ideal = args.prefix_len + args.prefix_requests * args.suffix_len
    on, off = results[True][2], results[False][2]
    print(f"\nprefix workload: {args.prefix_requests} requests = one {args.prefix_len}-token prefix + "
          f"{args.suffix_len} own tokens, {args.prefix_output} output tokens each; uptime load "
          f"{os.getloadavg()[0]:.2f}\n")
    print("| prefix caching | prompt tokens computed | × ideal (prefix + suffixes) | cache-hit tokens | steps |")
    print("|---|---:|---:|---:|---:|")
    for name, s in (("on", on), ("off", off)):
        print(f"| {name} | {s['prefill_tokens_computed']} | {s['prefill_tokens_computed'] / ideal:.2f} | "
              f"{s['prefix_cache_hit_tokens']} | {s['steps']} |")
    print(f"\ntime to first token of one more request: cold (no cache) {1000 * cold:.1f} ms, warm (prefix "
          f"cached) {1000 * warm:.1f} ms: {cold / warm:.1f}× faster (medians of 3)")
    same = results[True][0] == results[False][0]
    print(f"outputs with caching on equal those with it off: {same}")
    return results[True][1]


def plot(path, main_record, prefix_record, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    titles = (f"{args.requests} requests, continuous batching",
              f"{args.prefix_requests} requests sharing a {args.prefix_len}-token prefix, caching on")
    for ax, record, title in zip(axes, (main_record, prefix_record), titles, strict=True):
        steps = range(len(record))
        ax.plot(steps, [r[1] for r in record], label="blocks in use")
        ax.plot(steps, [r[2] for r in record], label="shared blocks (ref count > 1)")
        holding = [r[4] / r[3] * r[1] if r[3] else 0 for r in record]
        ax.plot(steps, holding, "--", label="blocks' worth of real tokens")
        ax.set_xlabel("engine step")
        ax.set_ylabel("KV blocks")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_peers:
        check_peers(args)
        with torch.inference_mode():
            cpu_peer_workload(args)
        return
    apply_common_args(args)
    if args.hf_peer:
        with torch.inference_mode():
            hf_peer_workload(args)
        return
    model = build_model(args)
    counter = ForwardCounter(model)
    with torch.inference_mode():
        warm_up(model, args)
        main_record = main_workload(model, args, counter)
        if args.sampled:
            sampled_workload(model, args)
        if args.structured:
            structured_workload(args)
        prefix_record = prefix_workload(model, args)
    if args.plot:
        plot(args.plot, main_record, prefix_record, args)


if __name__ == "__main__":
    main()
