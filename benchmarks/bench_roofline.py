"""The roofline of one decode step at batch B: from memory-bound to compute-bound (docs/08a section 1).

A decode step of B sequences reads every weight once, whatever B is, and each sequence's K/V; it does
about 2 FLOPs per weight per sequence. So its arithmetic intensity (FLOPs per byte read) grows with B, and
the step turns compute-bound once it passes the ridge point, this machine's FLOP/s / bandwidth. The FLOPs
and bytes come from the model's shapes (built on the meta device, nothing is allocated); the bandwidth
(reading a 256 MiB tensor, as bench_decode_speed.py measures it) and the matmul FLOP/s (a square fp32
matmul) are measured in this run, at the same thread count. The peer of each row is the roof itself:
"share of peak" is the attainable FLOP/s over the compute roof.

    uv run python benchmarks/bench_roofline.py --threads 1 --plot roofline.png
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn as nn
from _decode_roofline import kv_bytes_per_slot, measure_bandwidth, weight_bytes

from mini_transformer import TransformerConfig, TransformerLM

MODELS = {  # the two models of bench_decode_speed.py: GPT-2 layout, fp32
    "char": dict(vocab_size=65, n_layer=6, n_heads=6, d_model=384, d_ff=1536, max_seq_len=1024),
    "gpt2": dict(vocab_size=50257, n_layer=12, n_heads=12, d_model=768, d_ff=3072, max_seq_len=1024),
}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def step_cost(cfg: TransformerConfig, batch: int, context: int) -> tuple[float, float]:
    """(FLOPs, bytes read) of one decode step: `batch` sequences each add one token after `context` cached
    ones. FLOPs: 2 per weight of every linear layer per sequence, plus q·k and p·v over context + 1 keys
    per head. Bytes: every weight once (fp32) plus each sequence's K/V; activations are not counted."""
    linear, weights = model_counts(cfg)
    keys = context + 1
    flops = batch * (2 * linear + 4 * cfg.n_layer * cfg.n_heads * cfg.d_head * keys)
    nbytes = weights + batch * keys * kv_bytes_per_slot(cfg)
    return float(flops), float(nbytes)


_COUNTS: dict[str, tuple[int, int]] = {}


def model_counts(cfg: TransformerConfig) -> tuple[int, int]:
    """(weights of the linear layers, bytes of every weight read in a step) of cfg's model, built once per
    config on the meta device: a roofline asks for the same model at every batch and context."""
    key = repr(cfg)  # the config's every field
    if key not in _COUNTS:
        with torch.device("meta"):
            model = TransformerLM(cfg)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        _COUNTS[key] = linear, weight_bytes(model)
    return _COUNTS[key]


def measure_matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an (n, n) @ (n, n) fp32 matmul, the best of `repeats` (2·n³ FLOPs each)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def roofline_rows(bandwidth: float, peak_flops: float, context: int, batches=BATCHES) -> list[dict]:
    rows = []
    for name, fields in MODELS.items():
        cfg = TransformerConfig(**fields)
        for batch in batches:
            flops, nbytes = step_cost(cfg, batch, context)
            intensity = flops / nbytes
            attainable = min(peak_flops, intensity * bandwidth)
            rows.append(dict(model=name, batch=batch, intensity=intensity, attainable=attainable,
                             tok_s=batch * attainable / flops,
                             bound="compute" if intensity >= peak_flops / bandwidth else "memory"))
    return rows


def plot(rows: list[dict], bandwidth: float, peak_flops: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ridge = peak_flops / bandwidth
    xs = [min(r["intensity"] for r in rows) / 2, max(r["intensity"] for r in rows) * 2]
    ax.plot([xs[0], ridge], [xs[0] * bandwidth, peak_flops], "k--", label=f"memory roof {bandwidth / 1e9:.1f} GB/s")
    ax.plot([ridge, xs[1]], [peak_flops, peak_flops], "k-", label=f"compute roof {peak_flops / 1e9:.0f} GFLOP/s")
    for name, marker in (("char", "o"), ("gpt2", "s")):
        mine = [r for r in rows if r["model"] == name]
        ax.plot([r["intensity"] for r in mine], [r["attainable"] for r in mine], marker, label=f"{name}, B = 1..512")
    ax.axvline(ridge, color="grey", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="FLOPs per byte read", ylabel="attainable FLOP/s",
           title=f"decode step at batch B (ridge point {ridge:.1f} FLOP/byte)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads for both measurements")
    p.add_argument("--context", type=int, default=256, help="tokens already cached per sequence")
    p.add_argument("--matmul-size", type=int, default=2048)
    p.add_argument("--plot", metavar="PNG", help="write the roofline plot here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}")
    copy_bw, read_bw = measure_bandwidth()
    peak = measure_matmul_flops(args.matmul_size)
    ridge = peak / read_bw
    print(f"read bandwidth {read_bw / 1e9:.1f} GB/s (copy {copy_bw / 1e9:.1f}), fp32 matmul {peak / 1e9:.1f} GFLOP/s, "
          f"ridge point {ridge:.2f} FLOP/byte; load average at the end {os.getloadavg()[0]:.2f}")
    rows = roofline_rows(read_bw, peak, args.context)
    print(f"\ncontext {args.context} tokens per sequence, fp32")
    print("| model | B | FLOP/byte | bound | attainable GFLOP/s | share of peak | tok/s ceiling |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['batch']} | {r['intensity']:.2f} | {r['bound']} | {r['attainable'] / 1e9:.1f} | "
              f"{r['attainable'] / peak:.0%} | {r['tok_s']:.0f} |")
    for name in MODELS:
        first = next((r["batch"] for r in rows if r["model"] == name and r["bound"] == "compute"), None)
        print(f"{name}: compute-bound from B = {first}" if first else f"{name}: memory-bound up to B = {BATCHES[-1]}")
    if args.plot:
        plot(rows, read_bw, peak, args.plot)


if __name__ == "__main__":
    main()
