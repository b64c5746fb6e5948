"""The compiled batch-1 decode step's attention on the CPU: the C++ one-query kernel (attention/one_query_cpu.py,
mt_one_query::attend) against the decomposition inductor compiled before it (cpu_decode.py's
_one_query_attention), on the 124.7M Llama of vs_llama_cpp.py (768 hidden, 12 layers, GQA 12/4, D 64).

  attn   one layer's attention alone, as the step calls it (sdpa_attention over a 384-slot static slab,
         the written prefix visible), compiled through the decode backend both ways; contexts 65, 192
         and 320 (the start, middle and end of a 64 + 256-token run); us per call
  step   greedy decode, 64-token prompt prefilled, --new-tokens compiled steps, fp32 and bf16: ms per step
         with the kernel and with the decomposition (two compiled steps in this process, taking turns),
         then a torch.profiler run of the kernel step: mt_one_query::attend's time per layer and step

    OMP_NUM_THREADS=1 python benchmarks/bench_one_query.py --threads 1
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch
from _common import LLAMA_124M, add_common_args, apply_common_args, load_average, table, time_interleaved

from mini_transformer import TransformerConfig, TransformerLM
from mini_transformer.attention.sdpa import sdpa_attention
from mini_transformer.inference import cpu_decode, static_cache
from mini_transformer.inference.static_cache import StaticCache

SLAB = 384  # static_length(64 + 256)


def decomposition_only():
    """While active, _one_query_attention keeps its decomposition (what main compiled before the kernel)."""
    return mock.patch.object(cpu_decode, "_one_query_kernel_takes", lambda *args: False)


def compile_step(fn, use_kernel: bool, *args):
    """fn compiled through the decode backend, with or without the kernel. Every call of the decomposition's
    runs under decomposition_only(), since dynamo may compile again on a later call (another grad mode)."""
    compiled = torch.compile(fn, backend=cpu_decode.cpu_decode_backend, fullgraph=True, dynamic=False)

    def call(*call_args):
        if use_kernel:
            return compiled(*call_args)
        with decomposition_only():
            return compiled(*call_args)

    with torch.inference_mode():
        call(*args)
    return call


def attend_kernel(q, k, v, visible):  # two functions, not one: dynamo keeps one compiled graph per code object
    return sdpa_attention(q, k, v, causal=True, key_padding_mask=visible, dropout_p=0.0, scale=None)


def attend_decomposition(q, k, v, visible):
    return sdpa_attention(q, k, v, causal=True, key_padding_mask=visible, dropout_p=0.0, scale=None)


def run_attention(dtype: torch.dtype, calls: int, repeats: int) -> list[dict]:
    H, Hkv, D = LLAMA_124M["n_heads"], LLAMA_124M["n_kv_heads"], LLAMA_124M["d_model"] // LLAMA_124M["n_heads"]
    q, k, v = torch.randn(1, H, 1, D, dtype=dtype), torch.randn(1, Hkv, SLAB, D, dtype=dtype), torch.randn(
        1, Hkv, SLAB, D, dtype=dtype)
    visible = torch.zeros(1, SLAB, dtype=torch.bool)
    kernel = compile_step(attend_kernel, True, q, k, v, visible)
    decomposition = compile_step(attend_decomposition, False, q, k, v, visible)
    rows = []
    for context in (65, 192, 320):
        visible.zero_()
        visible[:, :context] = True
        torch.testing.assert_close(kernel(q, k, v, visible), decomposition(q, k, v, visible), rtol=0.02, atol=0.02)
        timings = time_interleaved({name: lambda f=f: [f(q, k, v, visible) for _ in range(calls)]
                                    for name, f in (("kernel", kernel), ("decomposition", decomposition))},
                                   repeats=repeats)
        us = {name: 1e6 * timing.median / calls for name, timing in timings.items()}
        rows.append(dict(dtype=str(dtype).removeprefix("torch."), context=context, kernel=us["kernel"],
                         decomposition=us["decomposition"], speedup=f"{us['decomposition'] / us['kernel']:.2f}x"))
    return rows


def decode_kernel(model, token, cache):
    return static_cache._decode_one(model, token, cache)


def decode_decomposition(model, token, cache):
    return static_cache._decode_one(model, token, cache)


def greedy_run(step, model, prompt, new_tokens: int) -> None:
    cache = StaticCache.for_model(model, 1, SLAB, dtype=next(model.parameters()).dtype)
    logits = model.logits(prompt, cache=cache)[:, -1]  # eager prefill
    token = logits.argmax(-1)
    for _ in range(new_tokens - 1):
        token = step(model, token, cache).argmax(-1)


def run_steps(model: TransformerLM, new_tokens: int, repeats: int) -> tuple[list[dict], str]:
    from torch.profiler import profile as torch_profile

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    prompt = torch.randint(3, LLAMA_124M["vocab_size"], (1, 64))
    cache = StaticCache.for_model(model, 1, SLAB, dtype=next(model.parameters()).dtype)
    with torch.inference_mode():
        model.logits(prompt, cache=cache)
    token = prompt[:, -1]
    steps = {"kernel": compile_step(decode_kernel, True, model, token, cache),
             "decomposition": compile_step(decode_decomposition, False, model, token, cache)}
    runs = {name: lambda s=s: greedy_run(s, model, prompt, new_tokens) for name, s in steps.items()}
    timings = time_interleaved(runs, repeats=repeats)
    rows = [dict(dtype=dtype, how=name, ms=1000 * t.median / (new_tokens - 1)) for name, t in timings.items()]
    with torch.inference_mode(), torch_profile() as prof:
        greedy_run(steps["kernel"], model, prompt, new_tokens)
    event = next(e for e in prof.key_averages() if e.key == "mt_one_query::attend")
    n_layer = model.config.n_layer
    note = (f"{dtype} kernel step, torch.profiler: mt_one_query::attend {event.count} calls, "
            f"{event.self_cpu_time_total / event.count:.1f} us per layer, "
            f"{event.self_cpu_time_total / event.count * n_layer / 1000:.3f} ms per step ({load_average()})")
    return rows, note


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["attn", "step"], choices=["attn", "step"])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    add_common_args(p, threads=1, device=False, plot=None)
    args = p.parse_args()
    apply_common_args(args)
    torch.manual_seed(0)
    if "attn" in args.parts:
        dtypes = [getattr(torch, name) for name in args.dtypes]
        rows = [row for dtype in dtypes for row in run_attention(dtype, 200, 5 * args.repeats)]
        print(f"\none layer's attention, 1 x 12/4 heads x D 64, {SLAB}-slot slab; {load_average()}")
        print(table(rows, dict(dtype="dtype", context="context (keys)", kernel="kernel us",
                               decomposition="decomposition us", speedup="kernel speed-up")))
    if "step" in args.parts:
        model = TransformerLM(TransformerConfig(**LLAMA_124M)).eval()
        for dtype in [getattr(torch, name) for name in args.dtypes]:
            rows, note = run_steps(model.to(dtype), args.new_tokens, args.repeats)
            print(f"\n{dtype} greedy decode step, {args.new_tokens} tokens, 64-token prompt; {load_average()}")
            print(table(rows, dict(how="how", dtype="dtype", ms="ms per step"), ratio=("ms", "decomposition")))
            print(note)


if __name__ == "__main__":
    main()
