"""bf16 decode on the CPU: the AVX512_BF16 GEMV (model/bf16_gemv.py) alone, and bf16 compiled decode
against fp32 compiled decode on the 124.7M Llama of issue 28 (vs_llama_cpp.py's layout, random weights).

  gemv    every weight matrix of the model (84 linears + the head: 249 MB in bf16), one row x at a time:
          the kernel, eager bf16 F.linear (oneDNN), the same with the kernel off (compiled reduction,
          inductor) and fp32 F.linear; GB/s = weight bytes / time (the read roof is measured beside it)
  decode  generate(compile=True), 64-token prompt, --new-tokens greedy steps (timed from the first sampled
          token to the last, as vs_llama_cpp.py), fp32 and bf16 alternating A B A B; greedy tokens of
          compiled bf16 compared with eager bf16
  ppl     perplexity of one random-token stream under fp32 and bf16 (random weights: only the ratio means
          anything - it says bf16 moves the model's predictions little)

    OMP_NUM_THREADS=1 python benchmarks/bench_bf16_gemv.py --threads 1
    python benchmarks/bench_bf16_gemv.py --threads 1 --parts decode --profile   # where a bf16 step goes
"""

from __future__ import annotations

import argparse
import copy
import os
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


def run_decode(fp32: TransformerLM, bf16: TransformerLM, n: int, repeats: int, profile: bool) -> None:
    prompt = torch.randint(3, LLAMA["vocab_size"], (1, 64))
    _, tokens = timed_generate(bf16, prompt, n)  # warm-up + compile, both
    timed_generate(fp32, prompt, n)
    eager = generate(bf16, prompt, n)
    same = next((i for i, (a, b) in enumerate(zip(tokens[0].tolist(), eager[0].tolist(), strict=True)) if a != b), n)
    best = {"fp32": float("inf"), "bf16": float("inf")}
    start_load = load()
    for _ in range(repeats):  # A B A B
        for name, model in (("fp32", fp32), ("bf16", bf16)):
            best[name] = min(best[name], timed_generate(model, prompt, n)[0])
    rows = [dict(method=f"{name} compiled", tok_s=(n - 1) / s) for name, s in best.items()]
    print(f"\ndecode, batch 1, prompt 64, {n - 1} timed steps, best of {repeats} alternating runs; "
          f"{start_load} at the start, {load()} at the end; compiled bf16 tokens == eager bf16 for the first "
          f"{same} of {n}")
    print(table(rows, {"method": "method", "tok_s": "tok/s"}, ratio=("tok_s", "fp32 compiled"),
                ratio_title="x fp32 compiled", higher_is_better=True))
    if profile:
        from torch.profiler import profile as torch_profile

        with torch_profile() as prof:
            timed_generate(bf16, prompt, n)
        print(f"\nprofile of {n} bf16 compiled decode steps (and one prefill): ops by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


@torch.inference_mode()
def run_perplexity(fp32: TransformerLM, bf16: TransformerLM) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, LLAMA["vocab_size"], (4, 129))
    ppl = {name: float(m(ids[:, :-1], targets=ids[:, 1:])[1].exp()) for name, m in (("fp32", fp32), ("bf16", bf16))}
    print(f"\nperplexity, random weights, 4 x 128 random tokens: fp32 {ppl['fp32']:.3f}, bf16 {ppl['bf16']:.3f} "
          f"({ppl['bf16'] / ppl['fp32']:.5f}x fp32)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["gemv", "decode", "ppl"], choices=["gemv", "decode", "ppl"])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="profile a bf16 compiled run after timing")
    add_common_args(p, threads=1, device=False, plot=None)
    args = p.parse_args(argv)
    apply_common_args(args)
    print(f"threads {args.threads}; kernel built with AVX512_BF16: {kernel_available()}; {load()}")
    _, read = measure_bandwidth("cpu")
    print(f"read bandwidth (sum of 256 MB fp32): {read / 1e9:.1f} GB/s; {load()}")
    fp32 = llama()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    if "gemv" in args.parts:
        run_gemv(fp32, args.repeats * 3)
    if "decode" in args.parts:
        run_decode(fp32, bf16, args.new_tokens, args.repeats, args.profile)
    if "ppl" in args.parts:
        run_perplexity(fp32, bf16)


if __name__ == "__main__":
    main()
