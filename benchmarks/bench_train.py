"""nanoGPT's CPU "baby" Shakespeare run, reproduced: does our loop learn as well, and how fast is a step?

Quality: char-level tiny shakespeare, block 64, batch 12, 4 layers, 4 heads, d_model 128, dropout 0,
2000 steps, lr 1e-3 (100 warmup steps, cosine to 1e-4), AdamW betas (0.9, 0.99), weight decay 0.1,
clip 1.0, eval every 250 steps on 20 batches. Three models with the same parameter count:
  gpt2          learned positions + LayerNorm + GELU, no biases (nanoGPT's model)   target val <= 1.88
  gpt2-init002  the same with nanoGPT's initial std 0.02 instead of our width rule (the reference)
  modern        RoPE + RMSNorm + SwiGLU, d_ff chosen so the parameter count matches  target val <= 1.80
All but gpt2-init002 start from std sqrt(2 / (5 * d_model)) = 0.056 (config.small_init_std).
Speed (--speed-steps N): the gpt2 model for N steps, first in a plain loop (the reference: the same
model, torch.optim.AdamW with its defaults, no schedule, clipping or autocast), then through train()
with each speed-up switched on in turn (attention backend, fused AdamW, torch.compile). The variants
take turns for --rounds rounds, so a change in the machine's load hits them all alike; ms/step is the
median over the rounds; each ratio is the median over the rounds of the plain loop's time over the
variant's in the same round, all in one process.

    python benchmarks/bench_train.py --data PATH/TO/tinyshakespeare.txt --plot train.png
    python benchmarks/bench_train.py --data PATH --steps 0 --speed-steps 100 --compile
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from _common import Timing, add_common_args, apply_common_args, time_calls

from mini_transformer import TransformerConfig, TransformerLM
from mini_transformer.tokenizer import CharTokenizer
from mini_transformer.training import TrainConfig, train
from mini_transformer.training.data import get_batch, load_text, split_tokens

# each model: (val loss target or None, plot colour)
MODELS = {"gpt2": (1.88, "tab:blue"), "gpt2-init002": (None, "tab:grey"), "modern": (1.80, "tab:orange")}
WARMUP_STEPS = 10  # step times left out of the medians (allocations, compilation)
PLAIN_LOOP = "plain loop, torch AdamW defaults"
NANOGPT_VAL = 1.8857  # nanoGPT's published val loss for this run (20 eval batches): a line on the loss plot


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
    times = result.step_times[min(WARMUP_STEPS, len(result.step_times) // 2):]
    ms = Timing(times).ms
    return result, ms, result.tokens_per_step / (ms / 1000)


@torch.no_grad()
def full_val_loss(result, args, block_size: int = 64, batch_size: int = 256) -> float:
    """Mean loss over EVERY non-overlapping window of the validation split: the 20-batch estimate without
    its sampling noise (20 batches of 12 x 64 characters cover ~14% of the split)."""
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
          f"{'ms/step':>8} {'tokens/s':>9}")
    for n, row in rows.items():
        final, target = row["result"].evals[-1][2], MODELS[n][0]
        ok = "-" if target is None else "yes" if final <= target else "NO"
        target_cell = "-" if target is None else f"{target:.2f}"
        print(f"{n:<13} {row['params']:>9,} {final:>10.4f} {row['full']:>10.4f} {target_cell:>7} {ok:>4} "
              f"{row['ms']:>8.1f} {row['tok_s']:>9.0f}")
    return rows


def plain_loop_times(vocab_size: int, args, steps: int) -> Timing:
    """The reference: the gpt2 model trained by the plainest loop on the same kind of batches, with
    torch.optim.AdamW at its defaults; nothing else (no schedule, clipping, accumulation or autocast)."""
    torch.manual_seed(args.seed)
    model = TransformerLM(gpt2_config(vocab_size)).to(args.device).train()
    optimizer = torch.optim.AdamW(model.parameters())
    text = load_text(args.data)[0]
    train_data, _ = split_tokens(torch.tensor(CharTokenizer.train(text).encode(text)), 64)
    generator = torch.Generator().manual_seed(args.seed)

    def step():
        x, y = get_batch(train_data, 12, 64, generator)  # (B, T), (B, T)
        _, loss = model(x.to(args.device), y.to(args.device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # our loop reads the loss every step too

    warmup = min(WARMUP_STEPS, steps // 2)
    return time_calls(step, repeats=steps - warmup, warmup=warmup, device=args.device, grad="grad")


def speed(args, vocab_size: int, work: Path) -> list:
    """The plain loop, then each switch of ours on top of the previous one, taking turns for args.rounds
    rounds; ratios against the plain loop."""
    variants = [
        ("naive attention, per-tensor AdamW", dict(attn_backend="naive"), dict(fused_optimizer=False)),
        ("sdpa attention, per-tensor AdamW", {}, dict(fused_optimizer=False)),
        ("sdpa attention, fused AdamW", {}, dict(fused_optimizer=True)),
    ]
    if args.compile:
        variants.append(("sdpa, fused AdamW, torch.compile", {}, dict(fused_optimizer=True, compile=True)))
    labels = [PLAIN_LOOP] + [label for label, _, _ in variants]
    ms = {label: [] for label in labels}
    for round_ in range(args.rounds):
        print(f"\n== speed round {round_ + 1}/{args.rounds}: the plain loop, then {len(variants)} variants", flush=True)
        ms[PLAIN_LOOP].append(plain_loop_times(vocab_size, args, args.speed_steps).ms)
        for label, model_changes, train_changes in variants:
            _, step_ms, _ = run(gpt2_config(vocab_size, **model_changes), args, args.speed_steps,
                                work / f"speed-{round_}-{labels.index(label)}",
                                eval_interval=args.speed_steps, **train_changes)
            ms[label].append(step_ms)
    tokens_per_step = 12 * 64
    rows = [(label, statistics.median(ms[label])) for label in labels]
    print(f"\n{'configuration':<36} {'ms/step':>8} {'tokens/s':>9} {'x plain loop':>12}   rounds (ms/step)")
    for label, step_ms in rows:
        # the ratio is paired: each round's plain loop against the same round's variant, then the median
        ratio = statistics.median(p / v for p, v in zip(ms[PLAIN_LOOP], ms[label], strict=True))
        each = " ".join(f"{m:.1f}" for m in ms[label])
        print(f"{label:<36} {step_ms:>8.1f} {tokens_per_step / step_ms * 1000:>9.0f} {ratio:>11.2f}x   {each}")
    return rows


def plot(rows: dict, speed_rows: list, path: str) -> None:
    """Loss curves of the quality runs and/or step times of the speed variants, side by side."""
    import matplotlib
    from matplotlib.figure import Figure

    # Chinese labels need a CJK font (Debian: fonts-noto-cjk); without it only those glyphs are missing
    matplotlib.rcParams["font.family"] = ["DejaVu Sans", "Noto Sans CJK SC"]
    panels = int(bool(rows)) + int(bool(speed_rows))
    fig = Figure(figsize=(5.5 * panels + 0.5, 4.5))
    if rows:
        ax = fig.add_subplot(1, panels, 1)
        for name, row in rows.items():
            target, colour = MODELS[name]
            evals = row["result"].evals
            ax.plot([e[0] for e in evals], [e[2] for e in evals], "o-", color=colour, label=f"{name} 验证 val")
            ax.plot([e[0] for e in evals], [e[1] for e in evals], "--", color=colour, alpha=0.6,
                    label=f"{name} 训练 train")
            if target is not None:
                ax.axhline(target, color=colour, linestyle=":", linewidth=1.2, label=f"{name} 目标 target ≤ {target}")
        ax.axhline(NANOGPT_VAL, color="tab:red", linestyle="-.", linewidth=0.8, label=f"nanoGPT {NANOGPT_VAL} (val)")
        ax.set(xlabel="训练步 step", ylabel="loss（nats / 字符 char）", title="tiny shakespeare，字符级 char level")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # below: curves stay clear
    if speed_rows:
        bx = fig.add_subplot(1, panels, panels)
        colours = ["tab:grey" if r[0] == PLAIN_LOOP else "tab:blue" for r in speed_rows]
        bx.barh([r[0] for r in speed_rows], [r[1] for r in speed_rows], color=colours)
        bx.set(xlabel="ms / step（中位数 median）", title="每步训练时间 step time（灰色：plain loop）")
        bx.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="shakespeare", help="shakespeare | PATH to tinyshakespeare.txt")
    parser.add_argument("--steps", type=int, default=2000, help="steps of the quality runs (0 = skip them)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--speed-steps", type=int, default=0, help="steps per speed variant and round (0 = skip)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the speed variants, taken in turns")
    parser.add_argument("--compile", action="store_true", help="torch.compile the quality runs; add a speed row")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_common_args(parser, plot="write the loss curves (and step times) here")
    args = parser.parse_args()
    apply_common_args(args)
    vocab_size = CharTokenizer.train(load_text(args.data)[0]).vocab_size
    print(f"torch {torch.__version__}, {args.threads} threads, device {args.device}, vocab {vocab_size}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = quality(args, vocab_size, Path(tmp)) if args.steps > 0 else {}
        speed_rows = speed(args, vocab_size, Path(tmp)) if args.speed_steps > 0 else []
    if args.plot and (rows or speed_rows):
        plot(rows, speed_rows, args.plot)


if __name__ == "__main__":
    main()
