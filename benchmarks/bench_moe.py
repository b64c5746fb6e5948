"""Mixture of Experts at nanoGPT's CPU "baby" config: does an MoE beat a dense model with the same active
parameters, does the auxiliary loss keep the experts balanced, and what does dispatch cost?

Training (as bench_train.py: char-level tiny shakespeare, block 64, batch 12, 4 layers, 4 heads,
d_model 128, lr 1e-3 cosine to 1e-4, AdamW (0.9, 0.99), weight decay 0.1, clip 1.0), three models:
  dense      RoPE + RMSNorm + SwiGLU, d_ff = 384
  moe        8 SwiGLU experts of d_ff 192, top-2: the same FFN parameters per token as dense (+ a router),
             4x the FFN parameters in all; load-balancing loss coefficient 0.05 (0.01 left the idlest
             expert at 0.40x its fair share after 400 steps with --seed 7)
  moe-noaux  the same MoE with the auxiliary loss switched off
The tokens each expert receives are counted in every training step (a global forward hook), and the
balance is reported per window of steps as max and min of (tokens / fair share) over experts and layers.
Targets: moe's val loss below dense's at equal steps; with the aux loss every expert within
[0.5, 2] x its fair share at the end.

Dispatch (--dispatch-reps N): one MoE layer's forward + backward on 12 x 64 tokens, against a dense SwiGLU
of the same active width, against the same MoE with a Python loop over experts instead of the grouped
matmul, and against the reference: a Python loop over tokens (`moe_per_token_reference`).

Decode (--decode-reps N): one MoE layer's dispatch at decode shapes (1 and 4 tokens, N*k <= E), forward
only, its three ways: the sorted path with the loop over experts (one host read per layer; what CUDA
and float64 ran before), the sorted path with the grouped matmul (the CPU's fp32/bf16 path, no host
read), and the gathered path (`dispatch_gathered`, no host read) that replaces the loop at these shapes.

    python benchmarks/bench_moe.py --data tinyshakespeare.txt --plot moe.png
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import torch
from _common import Timing, add_common_args, apply_common_args, time_calls

from mini_transformer import TransformerConfig
from mini_transformer.cli.info import active_parameters, count_parameters
from mini_transformer.model.moe import MoE, moe_per_token_reference, tokens_per_expert
from mini_transformer.training import TrainConfig, train

DENSE_FF, N_EXPERTS, TOP_K = 384, 8, 2
DECODE_TOKENS = (1, 4)  # N*k <= N_EXPERTS: the gathered path
MODELS = {  # name -> (config changes, plot colour)
    "dense": (dict(ffn="swiglu", d_ff=DENSE_FF), "tab:blue"),
    "moe": (dict(ffn="moe", d_ff=DENSE_FF // TOP_K, n_experts=N_EXPERTS, n_experts_per_tok=TOP_K,
                 moe_aux_loss_coef=0.05), "tab:orange"),
    "moe-noaux": (dict(ffn="moe", d_ff=DENSE_FF // TOP_K, n_experts=N_EXPERTS, n_experts_per_tok=TOP_K,
                       moe_aux_loss_coef=0.0), "tab:grey"),
}


def model_config(name: str, vocab_size: int, aux_coef: float | None = None) -> TransformerConfig:
    base = dict(vocab_size=vocab_size, d_model=128, n_heads=4, n_layer=4, max_seq_len=64, pos_emb="rope",
                norm="rmsnorm", bias=False, tie_weights=True, attn_backend="sdpa")
    changes = dict(MODELS[name][0])
    if aux_coef is not None and changes.get("moe_aux_loss_coef", 0) > 0:
        changes["moe_aux_loss_coef"] = aux_coef
    return TransformerConfig(**{**base, **changes})


class BalanceRecorder:
    """Counts the tokens each expert of each MoE layer receives in every TRAINING forward pass."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []  # one (n_layer, E) tensor per training step
        self._layer_counts: list[torch.Tensor] = []
        self._handle = torch.nn.modules.module.register_module_forward_hook(self._record)

    def _record(self, module, _inputs, _output):
        if isinstance(module, MoE) and module.training:
            self._layer_counts.append(tokens_per_expert(module.router_logits.detach(), module.top_k))
            if len(self._layer_counts) == self.n_layer:
                self.steps.append(torch.stack(self._layer_counts))
                self._layer_counts = []

    def start(self, n_layer: int) -> None:
        self.n_layer, self.steps, self._layer_counts = n_layer, [], []

    def window(self, first: int, last: int) -> tuple[float, float]:
        """(max, min) over layers and experts of tokens / fair share, summed over steps [first, last)."""
        counts = torch.stack(self.steps[first:last]).sum(0)  # (n_layer, E)
        share = counts / counts.sum(-1, keepdim=True) * counts.shape[-1]  # 1 = exactly the fair share
        return share.max().item(), share.min().item()

    def close(self) -> None:
        self._handle.remove()


def run(name: str, vocab_size: int, args, out: Path, recorder: BalanceRecorder) -> dict:
    cfg = model_config(name, vocab_size, args.aux_coef)
    groups = count_parameters(cfg)
    recorder.start(cfg.n_layer)
    train_cfg = TrainConfig(data=args.data, batch_size=12, block_size=64, max_steps=args.steps, lr=1e-3, min_lr=1e-4,
                            warmup_steps=min(100, args.steps // 10), weight_decay=0.1, beta1=0.9, beta2=0.99,
                            grad_clip=1.0, eval_interval=args.eval_interval, eval_batches=20, seed=args.seed,
                            device="cpu", out_dir=str(out / name), num_samples=0, progress=not args.quiet)
    print(f"\n== {name}: {sum(groups.values()):,} parameters, {active_parameters(cfg, groups):,} active per token",
          flush=True)
    result = train(train_cfg, cfg)
    times = result.step_times[min(10, len(result.step_times) // 2):]
    row = dict(result=result, total=sum(groups.values()), active=active_parameters(cfg, groups),
               ms=Timing(times).ms, balance=[])
    if cfg.ffn == "moe":
        w = args.balance_window
        row["balance"] = [(end, *recorder.window(end - w, end)) for end in range(w, len(recorder.steps) + 1, w)]
    return row


def quality(args, vocab_size: int, work: Path) -> dict:
    recorder = BalanceRecorder()
    try:
        rows = {name: run(name, vocab_size, args, work, recorder) for name in args.models}
    finally:
        recorder.close()
    print(f"\n{'model':<10} {'parameters':>11} {'active':>9} {'val loss':>9} {'vs dense':>9} {'ms/step':>8} "
          f"{'vs dense':>9} {'max/fair':>9} {'min/fair':>9}   (balance over the last {args.balance_window} steps)")
    dense = rows.get("dense")
    for name, row in rows.items():
        val = row["result"].evals[-1][2]
        d_val = f"{val - dense['result'].evals[-1][2]:+.4f}" if dense else "-"
        d_ms = f"{row['ms'] / dense['ms']:.2f}x" if dense else "-"
        hi, lo = (f"{row['balance'][-1][1]:.2f}", f"{row['balance'][-1][2]:.2f}") if row["balance"] else ("-", "-")
        print(f"{name:<10} {row['total']:>11,} {row['active']:>9,} {val:>9.4f} {d_val:>9} {row['ms']:>8.1f} "
              f"{d_ms:>9} {hi:>9} {lo:>9}")
    moe_rows = {n: r for n, r in rows.items() if r["balance"]}
    if moe_rows:
        print("\nexpert balance over training: max / min of tokens per expert, in fair shares (all layers)")
        print(f"{'steps up to':>11} " + " ".join(f"{n:>17}" for n in moe_rows))
        for i, (end, *_) in enumerate(next(iter(moe_rows.values()))["balance"]):
            cells = [f"{r['balance'][i][1]:.2f} / {r['balance'][i][2]:.2f}" for r in moe_rows.values()]
            print(f"{end:>11} " + " ".join(f"{c:>17}" for c in cells))
    return rows


@contextlib.contextmanager
def loop_over_experts():
    """The MoE layer with grouped_matmul swapped for its loop over experts (what it runs on CUDA)."""
    import mini_transformer.model.moe as moe_module

    original = moe_module.grouped_matmul
    moe_module.grouped_matmul = moe_module.grouped_matmul_loop
    try:
        yield
    finally:
        moe_module.grouped_matmul = original


def decode(args, vocab_size: int) -> list:
    """Dispatch alone (routed once beforehand), forward only, at decode shapes: (tokens, path, ms) rows."""
    from mini_transformer.model.moe import small_enough_to_gather

    torch.manual_seed(args.seed)
    moe = MoE(model_config("moe", vocab_size)).eval()
    rows = []
    for n_tokens in DECODE_TOKENS:
        assert small_enough_to_gather(n_tokens, TOP_K, N_EXPERTS)  # the shapes where the layer may gather
        rows += [(n_tokens, label, ms) for label, ms in decode_times(moe, n_tokens, args.decode_reps)]
    print(f"\nMoE dispatch at decode shapes, forward, C={moe.router.in_features}, {N_EXPERTS} experts of d_ff "
          f"{moe.experts.w_up.weight.shape[1]}, top-{TOP_K}, median of {args.decode_reps}")
    print(f"{'tokens':>6} {'path [where the layer takes it]':<38} {'us':>9} {'vs loop over experts':>21}")
    for n_tokens, label, ms in rows:
        loop_ms = next(r[2] for r in rows if r[0] == n_tokens)
        print(f"{n_tokens:>6} {label:<38} {1000 * ms:>9.1f} {ms / loop_ms:>20.2f}x")
    return rows


def decode_times(moe: MoE, n_tokens: int, reps: int) -> list[tuple[str, float]]:
    from mini_transformer.model.moe import dispatch as sorted_dispatch
    from mini_transformer.model.moe import dispatch_gathered, route

    x = torch.randn(n_tokens, moe.router.in_features)
    weights, experts = route(moe.router(x), moe.top_k, moe.renormalize)
    inputs = (x, weights, experts, moe.experts)

    def looped():
        with loop_over_experts():
            return sorted_dispatch(*inputs)

    cases = [("sorted + loop over experts (host read)", looped),
             ("sorted + grouped_mm [CPU fp32/bf16]", lambda: sorted_dispatch(*inputs)),
             ("gathered + bmm [CUDA, float64]", lambda: dispatch_gathered(*inputs))]
    return [(label, time_calls(fn, repeats=reps, grad="no_grad").ms) for label, fn in cases]


def dispatch(args, vocab_size: int) -> list:
    from tqdm import tqdm

    from mini_transformer.model.layers import SwiGLU

    torch.manual_seed(args.seed)
    moe_cfg = model_config("moe", vocab_size)
    moe, dense = MoE(moe_cfg), SwiGLU(model_config("dense", vocab_size))
    x = torch.randn(12, 64, moe_cfg.d_model, requires_grad=True)  # one training batch of tokens

    def fwd_bwd(f):
        return lambda: f(x).sum().backward()

    def expert_loop(x_):  # the same layer with grouped_matmul swapped for its per-expert loop
        with loop_over_experts():
            return moe(x_)

    cases = [("dense SwiGLU, same active width", fwd_bwd(dense), args.dispatch_reps),
             ("MoE, grouped matmul (ours)", fwd_bwd(moe), args.dispatch_reps),
             ("MoE, loop over experts", fwd_bwd(expert_loop), args.dispatch_reps),
             ("MoE, loop over tokens (reference)", fwd_bwd(lambda x_: moe_per_token_reference(moe, x_)), 3)]
    rows = [(label, time_calls(fn, repeats=reps, grad="grad").ms)
            for label, fn, reps in tqdm(cases, desc="dispatch", disable=args.quiet)]
    reference = rows[-1][1]
    print(f"\nMoE layer forward + backward, {x.shape[0] * x.shape[1]} tokens, C={moe_cfg.d_model}, "
          f"{N_EXPERTS} experts of d_ff {moe_cfg.d_ff}, top-{TOP_K}")
    print(f"{'layer':<36} {'ms':>9} {'vs dense':>9} {'vs token loop':>14}")
    for label, ms in rows:
        print(f"{label:<36} {ms:>9.2f} {ms / rows[0][1]:>8.2f}x {ms / reference:>13.4f}x")
    return rows


def plot(rows: dict, dispatch_rows: list, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.5))
    ax, bx, cx = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
    for name, row in rows.items():
        colour, evals = MODELS[name][1], row["result"].evals
        ax.plot([e[0] for e in evals], [e[2] for e in evals], "o-", color=colour, label=f"{name} val")
        if row["balance"]:
            steps = [b[0] for b in row["balance"]]
            bx.plot(steps, [b[1] for b in row["balance"]], "-", color=colour, label=f"{name} max")
            bx.plot(steps, [b[2] for b in row["balance"]], "--", color=colour, label=f"{name} min")
    ax.set(xlabel="step", ylabel="val loss (nats / char)", title="dense vs MoE, equal active parameters")
    for level in (0.5, 1.0, 2.0):
        bx.axhline(level, color="grey", linestyle=":", linewidth=0.8)
    bx.set(xlabel="step", ylabel="tokens / fair share", yscale="log", title="expert load (max and min over experts)")
    if dispatch_rows:
        cx.barh([r[0] for r in dispatch_rows], [r[1] for r in dispatch_rows], color="tab:orange")
        cx.set(xscale="log", xlabel="ms, forward + backward (log)", title="one MoE layer, 768 tokens")
        cx.invert_yaxis()
    for axis in (ax, bx):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="shakespeare", help="shakespeare | PATH to tinyshakespeare.txt")
    parser.add_argument("--steps", type=int, default=400, help="training steps per model (0 = skip training)")
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--balance-window", type=int, default=50, help="steps per balance measurement")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--aux-coef", type=float, help="the moe model's aux loss coefficient (default: MODELS)")
    parser.add_argument("--dispatch-reps", type=int, default=20, help="timed calls per dispatch case (0 = skip)")
    parser.add_argument("--decode-reps", type=int, default=200, help="timed calls per decode case (0 = skip)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_common_args(parser, threads=1, device=False, plot="write loss curves, expert balance and dispatch times here")
    args = parser.parse_args()
    apply_common_args(args)
    from mini_transformer.tokenizer import CharTokenizer
    from mini_transformer.training.data import load_text

    vocab_size = CharTokenizer.train(load_text(args.data)[0]).vocab_size
    print(f"torch {torch.__version__}, {args.threads} threads, vocab {vocab_size}")
    dispatch_rows = dispatch(args, vocab_size) if args.dispatch_reps > 0 else []
    if args.decode_reps > 0:
        decode(args, vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        rows = quality(args, vocab_size, Path(tmp)) if args.steps > 0 else {}
    if args.plot:
        plot(rows, dispatch_rows, args.plot)


if __name__ == "__main__":
    main()
