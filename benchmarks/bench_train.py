"""nanoGPT's CPU "baby" Shakespeare run, reproduced: does our loop learn as well, and how fast is a step?

Quality: char-level tiny shakespeare, block 64, batch 12, 4 layers, 4 heads, d_model 128, dropout 0,
2000 steps, lr 1e-3 (100 warmup steps, cosine to 1e-4), AdamW betas (0.9, 0.99), weight decay 0.1,
clip 1.0, eval every 250 steps on 20 batches. Three models with the same parameter count:
  gpt2          learned positions + LayerNorm + GELU, no biases (nanoGPT's model)   target val <= 1.88
  gpt2-init002  the same with nanoGPT's initial std 0.02 instead of our width rule (no target: the reference)
  modern        RoPE + RMSNorm + SwiGLU, d_ff chosen so the parameter count matches  target val <= 1.80
All but gpt2-init002 start from std sqrt(2 / (5 * d_model)) = 0.056 (config.small_init_std).
Speed (--speed-steps N): the gpt2 model for N steps with each speed-up switched on in turn
(attention backend, fused AdamW, torch.compile), ms/step medians and ratios measured in one process.

    python benchmarks/bench_train.py --data /work/shared/data/tinyshakespeare.txt --plot train.png
    python benchmarks/bench_train.py --data PATH --steps 200 --speed-steps 100 --compile
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mini_transformer import TransformerConfig, TransformerLM  # noqa: E402
from mini_transformer.train import TrainConfig, train  # noqa: E402

NANOGPT_VAL, NANOGPT_MS = 1.8857, 62.0  # nanoGPT's published baby run, measured on a 2-core machine
# each model: (val loss target or None, plot colour)
MODELS = {"gpt2": (1.88, "tab:blue"), "gpt2-init002": (None, "tab:grey"), "modern": (1.80, "tab:orange")}
SPEED_TARGET_MS = NANOGPT_MS / 1.2  # 1.2x nanoGPT's speed: <= ~52 ms/step


def gpt2_config(vocab_size: int, **changes) -> TransformerConfig:
    base = dict(vocab_size=vocab_size, d_model=128, n_heads=4, n_layer=4, max_seq_len=64, ffn="gelu",
                norm="layernorm", pos_emb="learned", bias=False, tie_weights=True, attn_backend="sdpa")
    return TransformerConfig(**{**base, **changes})


def modern_config(vocab_size: int) -> TransformerConfig:
    """RoPE + RMSNorm + SwiGLU with the d_ff that brings the parameter count closest to the gpt2 model's."""
    target = TransformerLM(gpt2_config(vocab_size)).num_parameters()

    def make(d_ff: int) -> TransformerConfig:
        return gpt2_config(vocab_size, pos_emb="rope", norm="rmsnorm", ffn="swiglu", d_ff=d_ff)

    p1, p2 = (TransformerLM(make(d)).num_parameters() for d in (1, 2))  # parameters grow linearly in d_ff
    d_ff = round((target - p1) / (p2 - p1)) + 1
    return make(d_ff)


def run(model_cfg: TransformerConfig, args, steps: int, out: Path, **changes):
    cfg = TrainConfig(data=args.data, batch_size=12, block_size=64, max_steps=steps, lr=1e-3, min_lr=1e-4,
                      warmup_steps=min(100, steps // 2), weight_decay=0.1, beta1=0.9, beta2=0.99, grad_clip=1.0,
                      eval_interval=changes.pop("eval_interval", 250), eval_batches=20, seed=args.seed,
                      device=args.device, out_dir=str(out), num_samples=0, progress=not args.quiet, **changes)
    result = train(cfg, model_cfg)
    times = result.step_times[min(10, len(result.step_times) // 2):]  # skip warm-up steps (allocations, compile)
    ms = 1000 * statistics.median(times)
    return result, ms, result.tokens_per_step / (ms / 1000)


@torch.no_grad()
def full_val_loss(result, args, block_size: int = 64, batch_size: int = 256) -> float:
    """Mean loss over EVERY non-overlapping window of the validation split: the 20-batch estimate without
    its sampling noise (20 batches of 12 x 64 characters cover ~14% of the split)."""
    from mini_transformer.data import load_text, split_tokens

    ids = torch.tensor(result.tokenizer.encode(load_text(args.data)[0]))
    _, val = split_tokens(ids, block_size)
    n = (len(val) - 1) // block_size
    x = val[: n * block_size].view(n, block_size)  # (N, T)
    y = val[1 : n * block_size + 1].view(n, block_size)  # (N, T): the same text shifted by one
    model = result.model.eval()
    total = sum(model(x[i : i + batch_size], y[i : i + batch_size])[1].item() * len(x[i : i + batch_size])
                for i in range(0, n, batch_size))
    return total / n


def model_config(name: str, vocab_size: int) -> TransformerConfig:
    if name == "modern":
        return modern_config(vocab_size)
    return gpt2_config(vocab_size, **({"init_std": 0.02} if name == "gpt2-init002" else {}))


def quality(args, vocab_size: int, work: Path) -> dict:
    rows = {}
    for name in args.models:
        cfg = model_config(name, vocab_size)
        n_params = TransformerLM(cfg).num_parameters()
        print(f"\n== {name}: {n_params:,} parameters (d_ff={cfg.d_ff}, init std {cfg.init_std:.3f}), "
              f"{args.steps} steps", flush=True)
        result, ms, tok_s = run(cfg, args, args.steps, work / name, compile=args.compile)
        rows[name] = dict(result=result, ms=ms, tok_s=tok_s, params=n_params, full=full_val_loss(result, args))
    print("\nval loss at each eval (train loss in brackets)")
    names = list(rows)
    print(f"{'step':>6} " + " ".join(f"{n:>18}" for n in names))
    for i, evaluation in enumerate(rows[names[0]]["result"].evals):
        cells = [f"{rows[n]['result'].evals[i][2]:.4f} ({rows[n]['result'].evals[i][1]:.4f})" for n in names]
        print(f"{int(evaluation[0]):>6} " + " ".join(f"{c:>18}" for c in cells))
    print(f"\n{'model':<13} {'params':>9} {'val (20 b)':>10} {'val (all)':>10} {'target':>7} {'ok':>4} "
          f"{'ms/step':>8} {'tokens/s':>9} {'vs nanoGPT':>10}")
    for n, row in rows.items():
        final, target = row["result"].evals[-1][2], MODELS[n][0]
        ok = "-" if target is None else "yes" if final <= target else "NO"
        target_cell = "-" if target is None else f"{target:.2f}"
        print(f"{n:<13} {row['params']:>9,} {final:>10.4f} {row['full']:>10.4f} {target_cell:>7} {ok:>4} "
              f"{row['ms']:>8.1f} {row['tok_s']:>9.0f} {NANOGPT_MS / row['ms']:>9.2f}x")
    print(f"nanoGPT: val {NANOGPT_VAL}, {NANOGPT_MS:.0f} ms/step; speed target <= {SPEED_TARGET_MS:.1f} ms/step")
    return rows


def speed(args, vocab_size: int, work: Path) -> list:
    """Each switch on top of the previous one; ratios against the first row."""
    variants = [
        ("naive attention, foreach AdamW", dict(attn_backend="naive"), dict(fused_optimizer=False)),
        ("sdpa attention, foreach AdamW", {}, dict(fused_optimizer=False)),
        ("sdpa attention, fused AdamW", {}, dict(fused_optimizer=True)),
    ]
    if args.compile:
        variants.append(("sdpa, fused AdamW, torch.compile", {}, dict(fused_optimizer=True, compile=True)))
    rows = []
    for label, model_changes, train_changes in variants:
        print(f"\n== speed: {label}", flush=True)
        _, ms, tok_s = run(gpt2_config(vocab_size, **model_changes), args, args.speed_steps, work / "speed",
                           eval_interval=args.speed_steps, **train_changes)
        rows.append((label, ms, tok_s))
    print(f"\n{'configuration':<34} {'ms/step':>8} {'tokens/s':>9} {'speed-up':>9} {'vs nanoGPT':>10}")
    for label, ms, tok_s in rows:
        print(f"{label:<34} {ms:>8.1f} {tok_s:>9.0f} {rows[0][1] / ms:>8.2f}x {NANOGPT_MS / ms:>9.2f}x")
    return rows


def plot(rows: dict, speed_rows: list, path: str) -> None:
    import matplotlib
    from matplotlib.figure import Figure

    # Chinese labels need a CJK font (Debian: fonts-noto-cjk); without it only those glyphs are missing
    matplotlib.rcParams["font.family"] = ["DejaVu Sans", "Noto Sans CJK SC"]
    fig = Figure(figsize=(11, 4.5))
    ax = fig.add_subplot(1, 2 if speed_rows else 1, 1)
    for name, row in rows.items():
        target, colour = MODELS[name]
        evals = row["result"].evals
        ax.plot([e[0] for e in evals], [e[2] for e in evals], "o-", color=colour, label=f"{name} 验证 val")
        ax.plot([e[0] for e in evals], [e[1] for e in evals], "--", color=colour, alpha=0.6, label=f"{name} 训练 train")
        if target is not None:
            ax.axhline(target, color=colour, linestyle=":", linewidth=1.2, label=f"{name} 目标 target ≤ {target}")
    ax.axhline(NANOGPT_VAL, color="tab:red", linestyle="-.", linewidth=0.8, label=f"nanoGPT {NANOGPT_VAL} (val)")
    ax.set(xlabel="训练步 step", ylabel="loss（nats / 字符 char）", title="tiny shakespeare，字符级 char level")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    if speed_rows:
        bx = fig.add_subplot(1, 2, 2)
        bx.barh([r[0] for r in speed_rows], [r[1] for r in speed_rows], color="tab:blue")
        bx.axvline(NANOGPT_MS, color="tab:red", linestyle="--", label=f"nanoGPT {NANOGPT_MS:.0f} ms")
        bx.axvline(SPEED_TARGET_MS, color="tab:green", linestyle=":", label=f"目标 target {SPEED_TARGET_MS:.0f} ms")
        bx.set(xlabel="ms / step（中位数 median）", title="每步训练时间 training step time")
        bx.invert_yaxis()
        bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="shakespeare", help="shakespeare | PATH to tinyshakespeare.txt")
    parser.add_argument("--steps", type=int, default=2000, help="steps of the quality runs (0 = skip them)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--speed-steps", type=int, default=0, help="steps per speed variant (0 = skip)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the quality runs; add a speed row")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--plot", metavar="PNG", help="write the loss curves (and step times) here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from mini_transformer.data import load_text
    from mini_transformer.tokenizer import CharTokenizer

    vocab_size = CharTokenizer.train(load_text(args.data)[0]).vocab_size
    print(f"torch {torch.__version__}, {args.threads} threads, device {args.device}, vocab {vocab_size}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = quality(args, vocab_size, Path(tmp)) if args.steps > 0 else {}
        speed_rows = speed(args, vocab_size, Path(tmp)) if args.speed_steps > 0 else []
    if args.plot:
        plot(rows, speed_rows, args.plot)


if __name__ == "__main__":
    main()
