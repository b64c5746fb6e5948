"""What does the KV cache buy? Decode tokens/s with the cache vs without, and ours vs Hugging Face.

One model, three ways to generate greedily from the same prompt:
  cache     our generate(): prefill once, then one token per step against the KV cache (O(T) per token)
  no-cache  our generate(use_cache=False): the whole sequence again every step (O(T^2) per token)
  hf        transformers' GPT2LMHeadModel.generate(do_sample=False) on the IDENTICAL weights (imported)

Default: GPT-2 architecture, 6 layers, 6 heads, d_model 384, and nanoGPT's 65-character vocabulary
(--vocab-size 50257 for GPT-2's); prompt 16 tokens, batch 1, CPU, all cores.

    python benchmarks/bench_decode.py                      # 64/128/256/512 new tokens, medians of 3 runs
    python benchmarks/bench_decode.py --lengths 32 64 --repeats 1 --plot decode.png
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from _common import GRAD_MODES, Timing, add_common_args, apply_common_args, time_call
from tqdm import tqdm

from mini_transformer import TransformerLM, generate

METHODS = ("cache", "no-cache", "hf")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512], help="new tokens per run")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-heads", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--vocab-size", type=int, default=65, help="65 = a character vocabulary (nanoGPT shakespeare-char)")
    p.add_argument("--backend", default="sdpa", choices=["naive", "sdpa"], help="our attention backend")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per (method, length); the median is shown")
    p.add_argument("--no-cache-repeats", type=int, default=None,
                   help="timed runs for the slow no-cache path (default: --repeats)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                   help="which ways to generate (cache is always run: the others are compared with it)")
    add_common_args(p, plot="write tokens/s vs new tokens to this PNG")
    return p.parse_args(argv)


def build_models(args):
    """A random HF GPT-2 and our model imported from the directory it saved: identical weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    max_len = args.prompt_len + max(args.lengths)
    hf_config = GPT2Config(
        vocab_size=args.vocab_size, n_embd=args.d_model, n_layer=args.n_layer, n_head=args.n_heads,
        n_positions=max(1024, max_len), bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(hf_config).eval().to(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = TransformerLM.from_pretrained(tmp, device=args.device, attn_backend=args.backend)
    return ours.eval(), hf


def run_once(method, ours, hf, idx, n_new) -> torch.Tensor:
    if method == "hf":
        out = hf.generate(idx, attention_mask=torch.ones_like(idx), do_sample=False, max_new_tokens=n_new,
                          min_new_tokens=n_new, pad_token_id=0, eos_token_id=None)
        return out[:, idx.shape[1]:]
    return generate(ours, idx, n_new, use_cache=method == "cache")


def main(argv=None) -> None:
    args = parse_args(argv)
    apply_common_args(args)
    ours, hf = build_models(args)
    methods = [m for m in METHODS if m == "cache" or m in args.methods]
    idx = torch.randint(1, args.vocab_size, (args.batch_size, args.prompt_len), device=args.device)

    # Same weights, same greedy tokens: check it before timing anything (also the warm-up, in the timed runs'
    # grad mode: inference mode)
    with GRAD_MODES["inference"]():
        check = {m: run_once(m, ours, hf, idx, 8) for m in methods}
    for m in methods[1:]:
        if not torch.equal(check[m], check["cache"]):
            raise SystemExit(f"{m} produced other tokens than cache: {check[m].tolist()} vs {check['cache'].tolist()}")

    # Methods take turns (cache, no-cache, hf, cache, ...) so that a change in machine load hits all of them.
    no_cache_repeats = args.no_cache_repeats or args.repeats
    jobs = [(n, m) for n in args.lengths for r in range(max(args.repeats, no_cache_repeats)) for m in methods
            if r < (no_cache_repeats if m == "no-cache" else args.repeats)]
    runs: dict[tuple[int, str], list[float]] = {}
    with GRAD_MODES["inference"]():
        for n, m in tqdm(jobs, desc="decode runs", unit="run"):
            seconds = time_call(lambda m=m, n=n: run_once(m, ours, hf, idx, n), args.device)[1]
            runs.setdefault((n, m), []).append(seconds)
    seconds = {key: Timing(values).median for key, values in runs.items()}

    tok_s = {key: args.batch_size * key[0] / s for key, s in seconds.items()}
    print(f"\nGPT-2 arch: {args.n_layer} layers, {args.n_heads} heads, d_model {args.d_model}, "
          f"vocab {args.vocab_size}; prompt {args.prompt_len}, batch {args.batch_size}, greedy, {args.device}, "
          f"{args.threads} thread(s), our backend {args.backend}; "
          f"median of {args.repeats} runs (no-cache: {no_cache_repeats})")
    header = f"{'new tokens':>10} | " + " | ".join(f"{m + ' tok/s':>15}" for m in methods)
    header += f" | {'cache/no-cache':>14}" if "no-cache" in methods else ""
    header += f" | {'ours/hf':>8}" if "hf" in methods else ""
    print(header)
    print("-" * len(header))
    for n in args.lengths:
        row = f"{n:>10} | " + " | ".join(f"{tok_s[n, m]:>15.1f}" for m in methods)
        if "no-cache" in methods:
            row += f" | {tok_s[n, 'cache'] / tok_s[n, 'no-cache']:>13.1f}x"
        if "hf" in methods:
            row += f" | {tok_s[n, 'cache'] / tok_s[n, 'hf']:>7.2f}x"
        print(row)

    if args.plot:
        plot(args.lengths, methods, tok_s, f"{args.n_layer}x{args.d_model} GPT-2, {args.device}", args.plot)


METHOD_LABELS = {"cache": "有缓存 with cache", "no-cache": "无缓存 without cache", "hf": "Hugging Face generate()"}


def plot(lengths: list[int], methods: list[str], tok_s: dict, model: str, path: str) -> None:
    """tokens/s against new tokens, one line per method; tok_s maps (new tokens, method) -> tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Chinese labels need a CJK font (Debian: fonts-noto-cjk); without it only those glyphs are missing
    plt.rcParams["font.family"] = ["DejaVu Sans", "Noto Sans CJK SC"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in methods:
        ax.plot(lengths, [tok_s[n, m] for n in lengths], marker="o", label=METHOD_LABELS.get(m, m))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("新生成的 token 数 new tokens")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"greedy 解码速度 decode speed, {model}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
