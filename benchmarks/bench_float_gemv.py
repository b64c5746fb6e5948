"""Float decode on the CPU: the C++ GEMV (model/float_gemv.py) alone, and compiled decode in fp32 and bf16
through it, on the 124.7M Llama of vs_llama_cpp.py (its layout, random weights).

  gemv    every weight matrix of the model (60 linears + the head: 400 MB fp32, 200 MB bf16/fp16), one row x
          at a time: the kernel in fp32, bf16 and fp16, against what the compiled step would run without it
          (inductor's fused multiply-and-sum reduction) and eager F.linear (MKL fp32, oneDNN bf16);
          GB/s = weight bytes / time (the read roof is measured beside it)
  decode  generate(compile=True), 64-token prompt, --new-tokens greedy steps (timed from the first sampled
          token to the last, as vs_llama_cpp.py): fp32 and bf16 through the kernels, and both with the C++
          kernels off (MINI_TRANSFORMER_NATIVE_KERNELS=0: inductor's fused reductions), in two worker processes taking
          turns A B C D A B C D; how many greedy tokens equal eager's (fp32 all of them; a near tie in bf16
          flips one: see tests/test_float_gemv.py)
  threads every GEMV kernel (fp32, bf16, fp16 and the int4 one, group 64) over the same weight matrices at
          each of --thread-counts, beside the read roof measured at that count in the same run: how much a
          second core adds to a GEMV is what it adds to the memory bandwidth (docs/08b §4); the int4 kernel
          also on the largest matrix alone (the output head), where a call's fixed costs hardly count, and its
          AVX2 loop (the mt_gemv_avx2 build, what a CPU without AVX-512 runs) where the machine can build it
  pages   the fp32 kernel and the read roof in 4 KB and in 2 MB pages at each --thread-counts: what the
          address translations cost a stream of weights (model/huge_pages.py; docs/08b §4)
  ppl     a small char model trained here, held-out perplexity scored token by token through the compiled
          decode step: fp32, bf16 (through the kernel), and bf16 eager forwards

    OMP_NUM_THREADS=1 python benchmarks/bench_float_gemv.py --threads 1
    python benchmarks/bench_float_gemv.py --threads 1 --parts decode --profile   # where a step goes
    python benchmarks/bench_float_gemv.py --parts threads --thread-counts 1 2    # the thread-scaling table
    python benchmarks/bench_float_gemv.py --parts pages --thread-counts 1 2      # 4 KB vs 2 MB pages
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
from _common import LLAMA_124M, add_common_args, apply_common_args, load_average, table, time_interleaved
from _decode_roofline import measure_bandwidth

from mini_transformer import TransformerConfig, TransformerLM, _native, generate
from mini_transformer.model import huge_pages
from mini_transformer.model.float_gemv import DTYPES, float_gemv, kernel_available
from mini_transformer.model.int4_gemv import kernel_available as int4_kernel_available
from mini_transformer.model.quantize import Int4Linear

NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def llama() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(**LLAMA_124M)).eval()


def run_gemv(model: TransformerLM, repeats: int) -> None:
    fp32 = [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)]
    weights = {dtype: [w.to(dtype) for w in fp32] for dtype in DTYPES}
    xs = {dtype: {w.shape[1]: torch.randn(1, w.shape[1]).to(dtype) for w in fp32} for dtype in DTYPES}

    def each(fn, dtype):
        return lambda: [fn(xs[dtype][w.shape[1]], w) for w in weights[dtype]]

    def compiled_sum(x, w):  # what the compiled step runs without the kernel: widen, multiply, sum, round
        return (x[:, :, None].float() * w.t()[None].float()).sum(dim=1).to(x.dtype)

    # 5 shapes x 3 dtypes = 15 graphs of one function: above dynamo's default limit of 8, past which it would
    # run the rest eagerly (materialising the (1, K, N) product: ~100x slower)
    torch._dynamo.config.recompile_limit = 32
    reduction = torch.compile(compiled_sum, dynamic=False)
    calls, kinds = {}, {}
    for dtype in DTYPES:
        name = NAMES[dtype]
        if kernel_available(dtype):
            calls[f"kernel {name}"], kinds[f"kernel {name}"] = each(float_gemv, dtype), dtype
        calls[f"inductor {name} reduction"], kinds[f"inductor {name} reduction"] = each(reduction, dtype), dtype
    for dtype, what in ((torch.float32, "MKL"), (torch.bfloat16, "oneDNN")):
        key = f"F.linear {NAMES[dtype]} ({what})"
        calls[key], kinds[key] = each(F.linear, dtype), dtype
    timings = time_interleaved(calls, repeats=repeats, warmup=2)
    rows = []
    for name, t in timings.items():
        nbytes = sum(w.nbytes for w in weights[kinds[name]])
        kernel = timings.get(f"kernel {NAMES[kinds[name]]}")
        rows.append(dict(method=name, ms=t.median * 1e3, gbs=nbytes / t.median / 1e9,
                         vs=f"{kernel.median / t.median:.2f}x" if kernel else "-"))
    print(f"\nGEMV over the model's {len(fp32)} weight matrices, 1 row, median of {repeats} alternating runs; "
          f"{load_average()}")
    print(table(rows, {"method": "method", "ms": "ms", "gbs": "GB/s", "vs": "x kernel of its dtype"}))


def thread_scaling_calls(model: TransformerLM) -> dict[str, tuple]:
    """name -> (a call running that GEMV kernel over every weight matrix of the model, one row x each, and the
    bytes it reads): the float kernel in each dtype it is built for, and the int4 one (group 64); the weights
    in 2 MB pages, as a compiled decode step reads them (model/huge_pages.py)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    calls = {}
    for dtype in (d for d in DTYPES if kernel_available(d)):
        weights = in_huge_pages([m.weight.detach().to(dtype) for m in linears])
        xs = {w.shape[1]: torch.randn(1, w.shape[1]).to(dtype) for w in weights}
        calls[f"kernel {NAMES[dtype]}"] = (lambda ws=weights, xs=xs: [float_gemv(xs[w.shape[1]], w) for w in ws],
                                           sum(w.nbytes for w in weights))
    if int4_kernel_available():
        layers = [Int4Linear.from_linear(m, 64) for m in linears]
        huge_pages.place_weights(nn.ModuleList(layers))
        xs = {m.in_features: torch.randn(1, m.in_features) for m in linears}
        # the tensors looked up once, as a compiled step holds them: a module's buffers are found by __getattr__
        args = [(xs[q.in_features], q.weight, q.gemv_scale_low) for q in layers]

        def int4(args=args):
            return [torch.ops.mt_gemv.int4(x, packed, scale_low, 64) for x, packed, scale_low in args]
        calls["kernel int4 (group 64)"] = (int4, sum(q.weight.nbytes + q.gemv_scale_low.nbytes for q in layers))
        # the largest matrix alone: what the loop streams once a call's fixed costs are small beside its reading
        i = max(range(len(layers)), key=lambda j: layers[j].weight.nbytes)
        calls["kernel int4, largest matrix alone"] = (lambda: int4(args[i:i + 1]),
                                                      layers[i].weight.nbytes + layers[i].gemv_scale_low.nbytes)
        if _native.build_variant("avx2"):
            avx2 = torch.ops.mt_gemv_avx2.int4
            calls["kernel int4, AVX2 loop"] = (lambda: [avx2(x, p, s, 64) for x, p, s in args],
                                               calls["kernel int4 (group 64)"][1])
    return calls


def in_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` in 2 MB pages where the OS gives them, as generate(compile=True) places a model's
    (place_weights copies each into the mapping and swaps it into the holder; the tensors passed stay as they are)."""
    holder = nn.Module()
    for i, t in enumerate(tensors):
        holder.register_buffer(f"t{i}", t)
    huge_pages.place_weights(holder)
    return [getattr(holder, f"t{i}") for i in range(len(tensors))]


def run_thread_scaling(model: TransformerLM, repeats: int, counts: list[int]) -> None:
    """GB/s of each GEMV kernel at each thread count, and the read roof (a sum over 4x the last-level cache,
    measure_bandwidth) at that count: the kernels split their weight rows over the threads, so a GEMV can gain
    from a second core only as much as the roof does."""
    calls = thread_scaling_calls(model)
    before, gbs = torch.get_num_threads(), {}
    try:
        for n in counts:
            torch.set_num_threads(n)
            gbs[("read roof (sum past the L3)", n)] = measure_bandwidth("cpu")[1] / 1e9
            timings = time_interleaved({name: fn for name, (fn, _) in calls.items()}, repeats=repeats, warmup=2)
            for name, (_, nbytes) in calls.items():
                gbs[(name, n)] = nbytes / timings[name].median / 1e9
    finally:
        torch.set_num_threads(before)
    rows, roof = [], "read roof (sum past the L3)"
    for name in [roof, *calls]:
        row = {"method": name, **{n: gbs[(name, n)] for n in counts}}
        row["gain"] = f"{gbs[(name, counts[-1])] / gbs[(name, counts[0])]:.2f}x"
        row["share"] = f"{gbs[(name, counts[-1])] / gbs[(roof, counts[-1])]:.0%}"
        rows.append(row)
    print(f"\nGEMV kernels over every weight matrix of the model, 1 row, median of {repeats} alternating runs, "
          f"GB/s at each thread count; {load_average()}")
    columns = {"method": "method", **{n: f"GB/s, {n} thread{'s' * (n > 1)}" for n in counts},
               "gain": f"{counts[-1]} vs {counts[0]}", "share": f"of the roof at {counts[-1]}"}
    print(table(rows, columns))


def run_page_sizes(model: TransformerLM, repeats: int, counts: list[int]) -> None:
    """The fp32 GEMV over every weight matrix of the model and the read roof, each in the allocator's 4 KB pages
    and in 2 MB pages, at each thread count: what a page-table walk per 4 KB costs a stream of weights."""
    if not (kernel_available(torch.float32) and huge_pages.available()):
        print("\npages: needs the fp32 kernel and 2 MB pages (Linux, transparent_hugepage not 'never')")
        return
    small = [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)]  # as torch allocated them
    calls = {"4 KB": small, "2 MB": in_huge_pages(small)}
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in small}
    nbytes, before, rows = sum(w.nbytes for w in small), torch.get_num_threads(), []
    try:
        for n in counts:
            torch.set_num_threads(n)
            roof = {pages: measure_bandwidth("cpu", huge=pages == "2 MB")[1] / 1e9 for pages in calls}
            timings = time_interleaved({pages: lambda ws=ws: [float_gemv(xs[w.shape[1]], w) for w in ws]
                                        for pages, ws in calls.items()}, repeats=repeats, warmup=2)
            gbs = {pages: nbytes / timings[pages].median / 1e9 for pages in calls}
            rows.append({"threads": n, "roof4": roof["4 KB"], "roof2": roof["2 MB"], "gemv4": gbs["4 KB"],
                         "gemv2": gbs["2 MB"], "gain": f"{gbs['2 MB'] / gbs['4 KB']:.2f}x"})
    finally:
        torch.set_num_threads(before)
    print(f"\nfp32 GEMV over every weight matrix of the model ({nbytes / 1e6:.0f} MB), 1 row, in 4 KB and 2 MB pages, "
          f"median of {repeats} alternating runs; {load_average()}")
    print(table(rows, {"threads": "threads", "roof4": "read roof, 4 KB pages", "roof2": "read roof, 2 MB pages",
                       "gemv4": "GEMV GB/s, 4 KB pages", "gemv2": "GEMV GB/s, 2 MB pages", "gain": "2 MB vs 4 KB"}))


def timed_generate(model, prompt, n, compile_: bool = True):
    stamps = []
    tokens = generate(model, prompt, n, compile=compile_, stream=lambda _: stamps.append(time.perf_counter()))
    return stamps[-1] - stamps[0], tokens


def worker(n: int) -> None:
    """One process, one configuration (the kernels on, or MINI_TRANSFORMER_NATIVE_KERNELS=0): loads both models,
    compiles on the first run of each, then times a run per request line ("fp32" / "bf16" / "eager-fp32" / ...)."""
    fp32 = llama()
    models = {"fp32": fp32, "bf16": copy.deepcopy(fp32).to(torch.bfloat16)}
    prompt = torch.randint(3, LLAMA_124M["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(2))
    for line in sys.stdin:
        name = line.strip()
        seconds, tokens = timed_generate(models[name.removeprefix("eager-")], prompt, n, not name.startswith("eager"))
        print(json.dumps({"seconds": seconds, "tokens": tokens[0].tolist()}), flush=True)


class Worker:
    def __init__(self, n: int, threads: int, kernel: bool):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MINI_TRANSFORMER_NATIVE_KERNELS": "1" if kernel else "0"}
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
    """fp32 and bf16 compiled through the C++ kernels, and both through inductor's reductions (the kernels
    off, in a second process): each compiled once, then timed in turns, A B C D A B C D."""
    on, off = Worker(n, threads, kernel=True), Worker(n, threads, kernel=False)
    runs = {"fp32 compiled, kernels": (on, "fp32"), "fp32 compiled, inductor reduction": (off, "fp32"),
            "bf16 compiled, kernels": (on, "bf16"), "bf16 compiled, inductor reduction": (off, "bf16")}
    tokens = {name: w.run(model)["tokens"] for name, (w, model) in runs.items()}  # warm-up + compile
    eager = {model: on.run(f"eager-{model}")["tokens"] for model in ("fp32", "bf16")}
    best = dict.fromkeys(runs, float("inf"))
    start_load = load_average()
    for _ in range(repeats):
        for name, (w, model) in runs.items():
            best[name] = min(best[name], w.run(model)["seconds"])
    on.close()
    off.close()

    def same(name):
        pairs = zip(tokens[name], eager[runs[name][1]], strict=True)
        return next((i for i, (x, y) in enumerate(pairs) if x != y), n)
    rows = [dict(method=name, tok_s=(n - 1) / s, ms=1e3 * s / (n - 1), eager=same(name)) for name, s in best.items()]
    print(f"\ndecode, batch 1, prompt 64, {n - 1} timed steps, best of {repeats} alternating runs; "
          f"{start_load} at the start, {load_average()} at the end")
    print(table(rows, {"method": "method", "tok_s": "tok/s", "ms": "ms/step", "eager": f"= eager tokens (of {n})"},
                ratio=("tok_s", "fp32 compiled, kernels"), ratio_title="x fp32 compiled", higher_is_better=True))


def run_profile(models: dict[str, TransformerLM], n: int) -> None:
    from torch.profiler import profile as torch_profile

    prompt = torch.randint(3, LLAMA_124M["vocab_size"], (1, 64))
    for name, model in models.items():
        timed_generate(model, prompt, n)  # compile
        with torch_profile() as prof:
            timed_generate(model, prompt, n)
        print(f"\nprofile of {n} {name} compiled decode steps (and one prefill): ops by self CPU time; "
              f"{load_average()}")
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

    root = tempfile.mkdtemp(prefix="bench-float-gemv-")
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
            logits = model.logits(prompt, cache=cache)[:, -1]
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
          f"{load_average()}")
    for name, nll in rows.items():
        ratio = math.exp(nll - rows["fp32 compiled decode"])
        print(f"  {name:>30}: {math.exp(nll):.4f}  ({ratio:.4f}x fp32)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["gemv", "decode", "ppl"],
                   choices=["gemv", "threads", "pages", "decode", "ppl"])
    p.add_argument("--thread-counts", nargs="+", type=int, default=[1, 2], help="threads: the counts compared")
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
    built = ", ".join(f"{NAMES[d]} {kernel_available(d)}" for d in DTYPES)
    print(f"threads {args.threads}; the kernel's SIMD loop (AVX-512 or AVX2) built for: {built}; {load_average()}")
    _, read = measure_bandwidth("cpu")
    print(f"read bandwidth (sum past the last-level cache): {read / 1e9:.1f} GB/s; {load_average()}")
    fp32 = llama()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    if "gemv" in args.parts:
        run_gemv(fp32, args.repeats * 3)
    if "threads" in args.parts:
        run_thread_scaling(fp32, args.repeats * 3, args.thread_counts)
    if "pages" in args.parts:
        run_page_sizes(fp32, args.repeats * 3, args.thread_counts)
    if "decode" in args.parts:
        run_decode(args.new_tokens, args.repeats, args.threads)
    if args.profile:
        run_profile({"fp32": fp32, "bf16": bf16}, args.new_tokens)
    if "ppl" in args.parts:
        run_perplexity(args.train_steps, args.data)


if __name__ == "__main__":
    main()
