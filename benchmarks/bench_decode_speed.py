"""How close does decoding get to the memory-bandwidth limit, and what do the three tricks buy?

Decoding one token at batch 1 reads every weight (and the KV cache so far) once and does about two flops
per weight: the ceiling is  memory bandwidth / bytes read per token.  This script measures the bandwidth
(a large tensor copy and a large read, same threads), counts the bytes each method reads per token, and times:

  speed (random weights, GPT-2 layout; identical weights in Hugging Face and ours)
    hf        transformers' GPT2LMHeadModel.generate(do_sample=False)
    hf-static the same with cache_implementation="static" and its forward compiled (transformers' own
              CompileConfig: mode="reduce-overhead", CUDA graphs, on cuda; inductor's default on the CPU)
    eager     our generate(): prefill, then one eager step per token from the KV cache
    compiled  generate(compile=True): StaticCache + a decode step compiled once
    int8      quantize(model, "int8"), compiled      int4  quantize(model, "int4", group 64), compiled
  tricks (a 6x384 char model and a 1-layer draft, both trained here on --data for --train-steps)
    perplexity on held-out text: fp32, bf16, int8, int4
    speculative decoding with the draft, and prompt lookup on a repetitive and on a plain prompt,
    against plain cached greedy decoding of the same prompt (outputs checked identical)
(bench_decode.py keeps the stage-3 question: cached vs uncached decode vs Hugging Face; the bandwidth, byte
counts and plot live in _decode_roofline.py beside this script.)

    python benchmarks/bench_decode_speed.py --data tinyshakespeare.txt --plot roofline.png
    python benchmarks/bench_decode_speed.py --parts speed --models char --new-tokens 128
    python benchmarks/bench_decode_speed.py --parts tricks --trained out/bench-decode   # trains once, then reuses
    python benchmarks/bench_decode_speed.py --device cuda --quick     # the GPU check: char model, speed only
    python benchmarks/bench_decode_speed.py --vs-llama-cpp --llama-python "$LLAMA_PYTHON"
On --device cuda every timed run ends with torch.cuda.synchronize(), the bandwidth is the GPU's (a copy and
a sum of 256 MB on the device), and our compiled step is a CUDA graph (mode="reduce-overhead").
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
from pathlib import Path

import torch
from _common import GRAD_MODES, add_common_args, apply_common_args, time_calls, time_interleaved
from _decode_roofline import kv_bytes_per_slot, measure_bandwidth, plot_roofline, weight_bytes
from tqdm import tqdm

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM, generate
from mini_transformer.inference.speculative import SpeculativeStats, speculative_generate
from mini_transformer.inference.static_cache import static_length
from mini_transformer.model.quantize import quantize

SPEED_METHODS = ("hf", "hf-static", "eager", "compiled", "int8", "int4")
COMPILED_METHODS = ("hf-static", "compiled", "int8", "int4")  # warmed up at the timed length: one static graph
MODELS = {  # name -> GPT-2 layout (n_layer, n_heads, d_model, vocab)
    "char": (6, 6, 384, 65),
    "gpt2": (12, 12, 768, 50257),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["speed", "tricks"], choices=["speed", "tricks"])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--methods", nargs="+", default=list(SPEED_METHODS), choices=SPEED_METHODS)
    p.add_argument("--new-tokens", type=int, default=512, help="new tokens per speed run of the char model")
    p.add_argument("--gpt2-new-tokens", type=int, default=64, help="new tokens per speed run of GPT-2 small")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--group-size", type=int, default=64, help="int4 group size")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method (interleaved); the median is kept")
    p.add_argument("--data", default=None, help="text to train on (default: tiny shakespeare, or pydoc offline)")
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--context", type=int, default=64,
                   help="block size the char models train on = their max_seq_len (prompt + new tokens fit in it)")
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--trained", metavar="DIR", help="load target/ and draft/ from DIR, or train and save them there")
    p.add_argument("--speculative-tokens", type=int, default=4, help="k drafted per target pass")
    add_common_args(p, plot="write the roofline plot (bytes/token vs tokens/s) here")
    p.add_argument("--profile", nargs="+", choices=SPEED_METHODS, default=[],
                   help="after timing, profile one run of these methods (torch.profiler) and print the top ops")
    p.add_argument("--vs-llama-cpp", action="store_true",
                   help="only the side-by-side with llama.cpp on a 124.7M random Llama (vs_llama_cpp.py)")
    p.add_argument("--llama-python", help="a Python whose environment imports llama_cpp (default: this one)")
    p.add_argument("--llama-threads", type=int, nargs="+", default=[1], help="thread counts, both systems")
    p.add_argument("--llama-new-tokens", type=int, default=256, help="new tokens per run (the first from prefill)")
    p.add_argument("--with-eager", action="store_true", help="--vs-llama-cpp: also our eager fp32")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run (the GPU check's): speed only, char model, 128 new tokens, 2 repeats, no int4")
    args = p.parse_args(argv)
    if args.quick:
        args.parts, args.models, args.new_tokens, args.repeats = ["speed"], ["char"], 128, 2
        args.methods = [m for m in args.methods if m != "int4"]
    return args


# ------------------------------------------------------------------------------------------ speed
def build_pair(name: str, max_len: int, device: str):
    """A random HF GPT-2 of this layout and our model imported from it: identical weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer, n_heads, d_model, vocab = MODELS[name]
    hf_cfg = GPT2Config(vocab_size=vocab, n_embd=d_model, n_layer=n_layer, n_head=n_heads,
                        n_positions=max(1024, max_len), bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(hf_cfg).eval().to(device)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = TransformerLM.from_pretrained(tmp, device=device, attn_backend="sdpa")
    return ours.eval(), hf


def hf_static_options(device: str) -> dict:
    """generate() keywords for transformers' static cache with its forward compiled (its documented way:
    cache_implementation="static" + a CompileConfig). On cuda transformers compiles by itself, default
    mode "reduce-overhead" (CUDA graphs); on the CPU it compiles only when the config says so
    (`_compile_all_devices`, transformers' own flag for it), and gets inductor's default mode."""
    from transformers import CompileConfig

    on_cuda = torch.device(device).type == "cuda"
    config = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead" if on_cuda else "default")
    config._compile_all_devices = True
    return dict(cache_implementation="static", compile_config=config)


def speed_runners(ours, hf, group_size):
    """method -> (model it runs, function of (idx, n_new))."""
    static = hf_static_options(str(ours.tok_emb.weight.device))

    def hf_run(idx, n, **options):
        return hf.generate(idx, attention_mask=torch.ones_like(idx), do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=0, eos_token_id=None, **options)[:, idx.shape[1]:]

    int8 = quantize(copy.deepcopy(ours), "int8")
    int4 = quantize(copy.deepcopy(ours), "int4", group_size=group_size)
    return {
        "hf": (ours, hf_run),
        "hf-static": (ours, lambda idx, n: hf_run(idx, n, **static)),
        "eager": (ours, lambda idx, n: generate(ours, idx, n)),
        "compiled": (ours, lambda idx, n: generate(ours, idx, n, compile=True)),
        "int8": (int8, lambda idx, n: generate(int8, idx, n, compile=True)),
        "int4": (int4, lambda idx, n: generate(int4, idx, n, compile=True)),
    }


def run_speed(name: str, args, bandwidth: float) -> list[dict]:
    n_new = args.new_tokens if name == "char" else args.gpt2_new_tokens
    T = args.prompt_len
    ours, hf = build_pair(name, T + n_new, args.device)
    runners = {m: r for m, r in speed_runners(ours, hf, args.group_size).items() if m in args.methods}
    idx = torch.randint(1, ours.config.vocab_size, (1, T), device=args.device)
    functions = {m: run for m, (_, run) in runners.items()}
    first, seconds = time_methods(functions, idx, n_new, args.repeats, args.device, name)
    for m in ("hf", "hf-static", "compiled"):
        if m in first and "eager" in first and not torch.equal(first[m], first["eager"]):
            raise SystemExit(f"{name}: {m} produced other greedy tokens than eager: {first[m]} vs {first['eager']}")
    for m in args.profile:
        if m in runners:
            profile_run(f"{name} {m}", lambda: runners[m][1](idx, n_new))  # noqa: B023
    rows = []
    for m, (model, _) in runners.items():
        # a static cache reads every slot (ours rounds its length up to a multiple of 128, HF's is T + n_new);
        # a growing one the mean length
        slots = {"hf-static": T + n_new, "hf": T + n_new / 2, "eager": T + n_new / 2}.get(
            m, static_length(T + n_new, ours.config.max_seq_len))
        read = weight_bytes(model) + slots * kv_bytes_per_slot(ours.config)
        tok_s = n_new / seconds[m]
        rows.append(dict(model=name, method=m, tok_s=tok_s, bytes=read, weights=weight_bytes(model),
                         ceiling=bandwidth / read, share=tok_s * read / bandwidth))
    return rows


def time_methods(functions: dict, idx: torch.Tensor, n_new: int, repeats: int, device: str, name: str = ""):
    """(first 8 tokens of each method's warm-up, median seconds of `repeats` timed runs each).

    Warm-up and timed runs share one grad mode, inference mode: a compiled forward guards on it (an
    inference tensor has other dispatch keys), so warming up outside it made HF's static compiled forward
    recompile (and, on cuda, record new CUDA graphs) inside the first timed run. Compiled methods warm up
    at the timed length: a static cache of another length would be another graph."""
    first = {}
    with GRAD_MODES["inference"]():  # the warm-up here (its tokens are compared), the timed runs in _common
        for m in tqdm(functions, desc=f"{name}: warm-up and compile", unit="method"):
            first[m] = functions[m](idx, n_new if m in COMPILED_METHODS else 8)[:, :8]
    calls = {m: (lambda fn=fn: fn(idx, n_new)) for m, fn in functions.items()}
    timings = time_interleaved(calls, repeats=repeats, warmup=0, device=device, grad="inference")
    return first, {m: t.median for m, t in timings.items()}


def profile_run(title: str, fn, top: int = 8) -> None:
    """Where the time of one run goes: the ops with the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.inference_mode(), profile(activities=activities) as prof:
        fn()
    print(f"\nprofile: {title}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


def print_speed(rows: list[dict]) -> None:
    refs = ("hf", "hf-static", "compiled")
    print(f"\n{'model':>5} | {'method':>9} | {'tok/s':>8} | {'MB/token':>8} | {'weights MB':>10} | "
          f"{'ceiling tok/s':>13} | {'share':>6} | {'x hf':>5} | {'x hf-static':>11} | {'x compiled':>10}")
    for row in rows:
        same = {r["method"]: r for r in rows if r["model"] == row["model"]}
        ratio = {ref: f"{row['tok_s'] / same[ref]['tok_s']:.2f}" if ref in same else "-" for ref in refs}
        print(f"{row['model']:>5} | {row['method']:>9} | {row['tok_s']:>8.1f} | {row['bytes'] / 1e6:>8.2f} | "
              f"{row['weights'] / 1e6:>10.2f} | {row['ceiling']:>13.0f} | {row['share']:>6.1%} | "
              f"{ratio['hf']:>5} | {ratio['hf-static']:>11} | {ratio['compiled']:>10}")


# ----------------------------------------------------------------------------------------- tricks
TRAINED_LAYOUT = dict(d_model=384, n_heads=6, ffn="gelu_tanh", bias=True, tie_weights=True, attn_backend="sdpa")


def trained_models(args):
    """(target, draft, held-out ids): trained here (batch 8 of --context tokens) or loaded from --trained."""
    from mini_transformer.tokenizer import load_tokenizer
    from mini_transformer.training import TrainConfig, train
    from mini_transformer.training.data import load_text, split_tokens

    root = Path(args.trained) if args.trained else Path(tempfile.mkdtemp(prefix="bench-decode-"))
    models = {}
    for role, n_layer in (("target", 6), ("draft", args.draft_layers)):
        path = root / role
        if not (path / "config.json").is_file():
            cfg = TrainConfig(data=args.data, max_steps=args.train_steps, batch_size=8, block_size=args.context,
                              eval_interval=args.train_steps, eval_batches=4, num_samples=0, device=args.device,
                              out_dir=str(root / f"{role}-run"), progress=True)
            model_cfg = TransformerConfig(vocab_size=65, n_layer=n_layer, max_seq_len=args.context, **TRAINED_LAYOUT)
            result = train(cfg, model_cfg)
            result.model.save_pretrained(path)
            result.tokenizer.save(path)
        models[role] = TransformerLM.from_pretrained(path, device=args.device).eval()
    tokenizer = load_tokenizer(root / "target")
    text, _ = load_text(args.data)
    _, val = split_tokens(torch.tensor(tokenizer.encode(text)), args.context)
    return models["target"], models["draft"], val.to(args.device)


@torch.inference_mode()
def perplexity(model, val: torch.Tensor, block: int, windows: int = 64) -> float:
    n = min(windows, (len(val) - 1) // block)
    x = val[:n * block].view(n, block)
    y = val[1:n * block + 1].view(n, block)
    losses = [model(x[i:i + 16], targets=y[i:i + 16])[1] for i in range(0, n, 16)]
    return float(torch.stack(losses).mean().exp())


def timed(fn, repeats: int = 3):
    """(output of a first, warm-up call; median seconds of `repeats` timed calls after it)."""
    with GRAD_MODES["inference"]():
        out = fn()
    return out, time_calls(fn, repeats=repeats, warmup=0).median


def run_tricks(args) -> None:
    target, draft, val = trained_models(args)
    ctx = args.context
    rows = [("fp32", perplexity(target, val, ctx))]
    rows.append(("bf16", perplexity(copy.deepcopy(target).to(torch.bfloat16), val, ctx)))
    for mode in ("int8", "int4"):
        rows.append((mode, perplexity(quantize(copy.deepcopy(target), mode, group_size=args.group_size), val, ctx)))
    print(f"\nheld-out perplexity of the trained 6x384 char model ({args.train_steps} steps; "
          f"{min(64, (len(val) - 1) // ctx)} held-out windows of {ctx} tokens)")
    for mode, ppl in rows:  # bf16: weights and activations in bf16, norms / softmax / the loss in fp32
        print(f"  {mode:>5}: {ppl:.4f}  ({ppl / rows[0][1]:.4f}x fp32)")

    half, quarter = ctx // 2, ctx // 4
    prompts = {  # name -> (prompt ids (1, T), new tokens): prompt + new tokens fill the context
        "plain": (val[None, :16], ctx - 16),
        "plain-long": (val[None, 200:200 + half], ctx - half),
        "repetitive": (val[None, 400:400 + quarter].repeat(1, 2), ctx - half),
    }
    k = args.speculative_tokens
    cases = [("speculative", "plain", draft), ("prompt lookup", "plain-long", "prompt_lookup"),
             ("prompt lookup", "repetitive", "prompt_lookup")]
    print(f"\ngreedy, batch 1, {args.threads} thread(s), median of 3 runs; k = {k} drafted tokens per target pass; "
          f"draft = {args.draft_layers} layer(s) x 384")
    print(f"{'method':>13} | {'prompt':>10} | {'new':>4} | {'plain tok/s':>11} | {'tok/s':>7} | {'speed-up':>8} | "
          f"{'accepted':>8} | {'tokens/pass':>11} | identical")
    for method, prompt_name, drafter in cases:
        idx, n_new = prompts[prompt_name]
        params = SamplingParams(max_tokens=n_new)
        generate(target, idx, 4)  # warm-up
        plain, plain_s = timed(lambda: generate(target, idx, params))  # noqa: B023
        stats = SpeculativeStats()  # counts of the first run (greedy: every run is the same)
        fast, fast_s = timed(lambda: speculative_generate(target, idx, params, drafter, k,  # noqa: B023
                                                          stats=stats if not stats.rounds else None))  # noqa: B023
        print(f"{method:>13} | {prompt_name:>10} | {n_new:>4} | {n_new / plain_s:>11.1f} | {n_new / fast_s:>7.1f} | "
              f"{plain_s / fast_s:>7.2f}x | {stats.acceptance_rate:>8.1%} | {n_new / stats.rounds:>11.2f} | "
              f"{torch.equal(plain, fast)}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.vs_llama_cpp:
        import vs_llama_cpp

        return vs_llama_cpp.run(args)
    apply_common_args(args)
    print(f"threads {args.threads}, device {args.device}, load average {os.getloadavg()[0]:.2f}")
    if "speed" in args.parts:
        copy_bw, bandwidth = measure_bandwidth(args.device)
        print(f"memory bandwidth (4x the last-level cache): copy (read + write) {copy_bw / 1e9:.2f} GB/s, "
              f"read {bandwidth / 1e9:.2f} GB/s (the ceiling uses read)")
        rows = [row for name in args.models for row in run_speed(name, args, bandwidth)]
        print(f"batch 1, greedy, prompt {args.prompt_len}; new tokens: char {args.new_tokens}, "
              f"gpt2 {args.gpt2_new_tokens}; median of {args.repeats} interleaved runs; int8/int4 compiled; "
              f"int4 group {args.group_size}")
        print_speed(rows)
        if args.plot:
            plot_roofline(rows, bandwidth, args.plot)
    if "tricks" in args.parts:
        run_tricks(args)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if "speed" in args.parts and "compiled" in args.methods:  # the last line: gpu_check's summary of this run
        print("; ".join(speed_summary(rows, name) for name in args.models))


def speed_summary(rows: list[dict], model: str) -> str:
    same = {r["method"]: r for r in rows if r["model"] == model}
    ours = same["compiled"]
    ratios = "".join(f", {ours['tok_s'] / same[ref]['tok_s']:.2f}x {ref}" for ref in ("hf", "hf-static") if ref in same)
    return f"{model} compiled {ours['tok_s']:.0f} tok/s ({ours['share']:.0%} of the ceiling{ratios})"


if __name__ == "__main__":
    main()
