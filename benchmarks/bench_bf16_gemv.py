"""bf16 decode on the CPU: the AVX512_BF16 GEMV (model/bf16_gemv.py) alone, and bf16 compiled decode
against fp32 compiled decode on the 124.7M Llama of issue 28 (vs_llama_cpp.py's layout, random weights).

  gemv    every weight matrix of the model (60 linears + the head: 200 MB in bf16), one row x at a time:
          the kernel, eager bf16 F.linear (oneDNN), the same with the kernel off (compiled reduction,
          inductor) and fp32 F.linear; GB/s = weight bytes / time (the read roof is measured beside it)
  decode  generate(compile=True), 64-token prompt, --new-tokens greedy steps (timed from the first sampled
          token to the last, as vs_llama_cpp.py): fp32, bf16 through the kernel, and bf16 with the kernel off
          (MT_NATIVE_KERNELS=0: inductor's fused reduction), in two worker processes taking turns A B C A B C;
          how many greedy tokens of compiled bf16 equal eager bf16's before the first difference (a near
          tie in bf16 flips it: see tests/test_bf16_gemv.py)
  ppl     a small char model trained here, held-out perplexity scored token by token through the compiled
          decode step: fp32, bf16 (through the kernel), and bf16 eager forwards

    OMP_NUM_THREADS=1 python benchmarks/bench_bf16_gemv.py --threads 1
    python benchmarks/bench_bf16_gemv.py --threads 1 --parts decode --profile   # where a bf16 step goes
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import add_common_args, apply_common_args, table, time_interleaved
from decode_roofline import measure_bandwidth

from mini_transformer import TransformerConfig, TransformerLM, generate
from mini_transformer.model.bf16_gemv import bf16_gemv, kernel_available

LLAMA = dict(vocab_size=32000, d_model=768, n_heads=12, n_kv_heads=4, n_layer=12, d_ff=2048, max_seq_len=1024,
             pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False, tie_weights=False, attn_backend="sdpa")


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


def llama() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(**LLAMA)).eval()


def run_gemv(model: TransformerLM, repeats: int) -> None:
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)]
    bf16 = [w.bfloat16() for w in weights]
    nbytes = sum(w.nbytes for w in bf16)
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}  # one activation row per input width

    def kernel():
        for w in bf16:
            bf16_gemv(xs16[w.shape[1]], w)

    def compiled_sum(x, w):  # what the compiled step did for bf16 before the kernel: widen, multiply, sum
        return (x[:, :, None].float() * w.t()[None].float()).sum(dim=1).bfloat16()

    reduction = torch.compile(compiled_sum, dynamic=False)
    xs16 = {k: x.bfloat16() for k, x in xs.items()}
    calls = {"kernel bf16": kernel,
             "oneDNN bf16 F.linear": lambda: [F.linear(xs16[w.shape[1]], w) for w in bf16],
             "inductor bf16 reduction": lambda: [reduction(xs16[w.shape[1]], w) for w in bf16],
             "fp32 F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in weights]}
    timings = time_interleaved(calls, repeats=repeats, warmup=2)
    rows = [dict(method=name, ms=t.median * 1e3, gbs=(nbytes * (2 if "fp32" in name else 1)) / t.median / 1e9)
            for name, t in timings.items()]
    print(f"\nGEMV over the model's {len(bf16)} weight matrices ({nbytes / 1e6:.0f} MB bf16), 1 row, "
          f"median of {repeats} alternating runs; {load()}")
    print(table(rows, {"method": "method", "ms": "ms", "gbs": "GB/s"}, ratio=("ms", "kernel bf16"),
                ratio_title="x kernel"))


def timed_generate(model, prompt, n, compile_: bool = True):
    stamps = []
    tokens = generate(model, prompt, n, compile=compile_, stream=lambda _: stamps.append(time.perf_counter()))
    return stamps[-1] - stamps[0], tokens


def worker(n: int) -> None:
    """One process, one configuration (the kernel on, or MT_NATIVE_KERNELS=0): loads both models, compiles on
    the first run of each, then times a run per request line ("fp32" / "bf16" / "eager-bf16")."""
    fp32 = llama()
    models = {"fp32": fp32, "bf16": copy.deepcopy(fp32).to(torch.bfloat16)}
    prompt = torch.randint(3, LLAMA["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(2))
    for line in sys.stdin:
        name = line.strip()
        seconds, tokens = timed_generate(models[name.removeprefix("eager-")], prompt, n, not name.startswith("eager"))
        print(json.dumps({"seconds": seconds, "tokens": tokens[0].tolist()}), flush=True)


class Worker:
    def __init__(self, n: int, threads: int, kernel: bool):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MT_NATIVE_KERNELS": "1" if kernel else "0"}
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(n), "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def run(self, name: str) -> dict:
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run_decode(n: int, repeats: int, threads: int) -> None:
    """fp32 compiled, bf16 compiled through the kernel, bf16 compiled through inductor's reduction (the kernel
    off, in a second process): each compiled once, then timed in turns, A B C A B C."""
    on, off = Worker(n, threads, kernel=True), Worker(n, threads, kernel=False)
    runs = {"fp32 compiled": (on, "fp32"), "bf16 compiled, kernel": (on, "bf16"),
            "bf16 compiled, inductor reduction": (off, "bf16")}
    tokens = {name: w.run(model)["tokens"] for name, (w, model) in runs.items()}  # warm-up + compile
    eager = on.run("eager-bf16")["tokens"]
    best = dict.fromkeys(runs, float("inf"))
    start_load = load()
    for _ in range(repeats):
        for name, (w, model) in runs.items():
            best[name] = min(best[name], w.run(model)["seconds"])
    on.close()
    off.close()

    def same(a):
        return next((i for i, (x, y) in enumerate(zip(a, eager, strict=True)) if x != y), n)
    rows = [dict(method=name, tok_s=(n - 1) / s, ms=1e3 * s / (n - 1), eager=same(tokens[name]) if "bf16" in name
                 else "-") for name, s in best.items()]
    print(f"\ndecode, batch 1, prompt 64, {n - 1} timed steps, best of {repeats} alternating runs; "
          f"{start_load} at the start, {load()} at the end")
    print(table(rows, {"method": "method", "tok_s": "tok/s", "ms": "ms/step", "eager": f"= eager bf16 tokens (of {n})"},
                ratio=("tok_s", "fp32 compiled"), ratio_title="x fp32 compiled", higher_is_better=True))


def run_profile(bf16: TransformerLM, n: int) -> None:
    from torch.profiler import profile as torch_profile

    prompt = torch.randint(3, LLAMA["vocab_size"], (1, 64))
    timed_generate(bf16, prompt, n)  # compile
    with torch_profile() as prof:
        timed_generate(bf16, prompt, n)
    print(f"\nprofile of {n} bf16 compiled decode steps (and one prefill): ops by self CPU time; {load()}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=50))


def run_perplexity(steps: int, data: str | None) -> None:
    """A small Llama-style char model trained here (2 x 96: K = 96 and 256 take the kernel's full chunks and,
    for 96, no tail; 8 held-out windows in one batch = 8 rows), scored token by token the way decode runs:
    8 prompt tokens prefilled, then 56 single-token steps of the compiled step (bf16: the kernel), each
    predicting the next token. Against fp32 through the same compiled step and bf16 eager full forwards."""
    from mini_transformer.inference.static_cache import StaticCache, compiled_decode_step
    from mini_transformer.tokenizer import load_tokenizer
    from mini_transformer.training import TrainConfig, train
    from mini_transformer.training.data import load_text, split_tokens

    root = tempfile.mkdtemp(prefix="bench-bf16-")
    cfg = TrainConfig(data=data, max_steps=steps, batch_size=16, block_size=64, eval_interval=steps, eval_batches=2,
                      num_samples=0, device="cpu", out_dir=root, progress=False)
    layout = TransformerConfig(vocab_size=65, d_model=96, n_heads=4, n_kv_heads=2, n_layer=2, d_ff=256, max_seq_len=64,
                               pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False, tie_weights=False)
    result = train(cfg, layout)
    result.model.save_pretrained(root + "/model")
    result.tokenizer.save(root + "/model")
    fp32 = TransformerLM.from_pretrained(root + "/model", attn_backend="sdpa").eval()
    text, _ = load_text(data)
    _, val = split_tokens(torch.tensor(load_tokenizer(root + "/model").encode(text)), 64)
    windows = val[:8 * 65].view(8, 65)  # (8, 65): 64 inputs + the last target
    prompt, targets = windows[:, :8], windows[:, 8:]  # 56 decode steps, each scored on the next token

    def decode_nll(model):
        cache = StaticCache.for_model(model.config, 8, 64, dtype=model.tok_emb.weight.dtype)
        step, nll = compiled_decode_step("cpu"), []
        with torch.inference_mode():
            logits = model(prompt, cache=cache, check=False)[0][:, -1]
            for t in range(56):
                nll.append(F.cross_entropy(logits.float(), targets[:, t]))
                logits = step(model, targets[:, t], cache)
        return float(torch.stack(nll).mean())

    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    with torch.inference_mode():
        eager = float(F.cross_entropy(bf16(windows[:, :-1])[0][:, 7:].float().flatten(0, 1),
                                      windows[:, 8:].reshape(-1)))
    rows = {"fp32 compiled decode": decode_nll(fp32), "bf16 compiled decode (kernel)": decode_nll(bf16),
            "bf16 eager forward": eager}
    print(f"\nperplexity of a 2 x 96 char model trained {steps} steps here, 8 held-out windows, positions 8-63; "
          f"{load()}")
    for name, nll in rows.items():
        ratio = math.exp(nll - rows["fp32 compiled decode"])
        print(f"  {name:>30}: {math.exp(nll):.4f}  ({ratio:.4f}x fp32)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["gemv", "decode", "ppl"], choices=["gemv", "decode", "ppl"])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=300, help="ppl: steps of the small char model")
    p.add_argument("--data", default=None, help="ppl: text to train on (default: tiny shakespeare)")
    p.add_argument("--profile", action="store_true", help="profile a bf16 compiled run after timing")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # run_decode's processes
    add_common_args(p, threads=1, device=False, plot=None)
    args = p.parse_args(argv)
    apply_common_args(args)
    if args.worker:
        return worker(args.worker)
    print(f"threads {args.threads}; kernel built with AVX512_BF16: {kernel_available()}; {load()}")
    _, read = measure_bandwidth("cpu")
    print(f"read bandwidth (sum of 256 MB fp32): {read / 1e9:.1f} GB/s; {load()}")
    fp32 = llama()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    if "gemv" in args.parts:
        run_gemv(fp32, args.repeats * 3)
    if "decode" in args.parts:
        run_decode(args.new_tokens, args.repeats, args.threads)
    if args.profile:
        run_profile(bf16, args.new_tokens)
    if "ppl" in args.parts:
        run_perplexity(args.train_steps, args.data)


if __name__ == "__main__":
    main()
