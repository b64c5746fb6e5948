"""The two stages of tools/gpu_check.py that are Python rather than an existing script.

    python tools/_gpu_check_workers.py errors                # attention error table on CUDA
    python tools/_gpu_check_workers.py train --out-dir DIR   # short bf16 + torch.compile training run

Each prints a markdown table (for the results file) and, as its last line, one JSON object that
gpu_check.py reads. Both need CUDA and the package on the path (gpu_check sets PYTHONPATH=src).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

# Bounds on the relative error |got - want| / |want| (2-norms) of out, dq, dk and dv at T=1024. The tests
# bound the max absolute error at their small sizes (docs/04); at T=1024 sums run over more keys and
# queries, so the relative error is the fair measure: IEEE float32 stays far under 1e-5 (TF32 would give
# ~3e-4), fp16 operands (11-bit mantissa) ~1e-3, bf16 (8-bit) a few 1e-3.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _out_and_grads(backend: str, q, k, v, grad_out, keep):
    from mini_transformer.attention import attention

    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, causal=True, key_padding_mask=keep, backend=backend)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


def attention_errors(device="cuda", batch=2, heads=8, kv_heads=2, T=1024, head_dim=64) -> list[dict]:
    """out, dq, dk, dv of sdpa / tiled / triton at each dtype against naive in float64 on the same
    (already rounded) inputs: causal, GQA, and the second row left-padded by T // 5 tokens. A row is ok
    when all four relative errors are within TOLERANCE and nothing is NaN or inf."""
    torch.manual_seed(0)
    keep = torch.ones(batch, T, dtype=torch.bool, device=device)
    keep[1, : T // 5] = False
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q = torch.randn(batch, heads, T, head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(batch, kv_heads, T, head_dim, device=device, dtype=dtype) for _ in range(2))
        grad_out = torch.randn_like(q)
        want = _out_and_grads("naive", q.double(), k.double(), v.double(), grad_out.double(), keep)
        for backend in ("sdpa", "tiled", "triton"):
            got = _out_and_grads(backend, q, k, v, grad_out, keep)
            row = dict(backend=backend, dtype=DTYPE_NAMES[dtype], tolerance=TOLERANCE[dtype])
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
                row[name] = (g.double() - w).abs().max().item()
                row["rel_" + name] = ((g.double() - w).norm() / w.norm()).item()
            row["finite"] = all(bool(torch.isfinite(g).all()) for g in got)
            row["ok"] = row["finite"] and max(row["rel_" + n] for n in ("out", "dq", "dk", "dv")) <= row["tolerance"]
            rows.append(row)
    return rows


def errors_markdown(rows: list[dict]) -> str:
    names = ("out", "dq", "dk", "dv", "rel_out", "rel_dq", "rel_dk", "rel_dv", "tolerance")
    lines = ["| backend | dtype | max abs: out | dq | dk | dv | relative: out | dq | dk | dv | bound | ok |",
             "|---|---|" + "---:|" * 9 + "---|"]
    for r in rows:
        cells = " | ".join(f"{r[n]:.2g}" for n in names)
        lines.append(f"| {r['backend']} | {r['dtype']} | {cells} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def train_run(out_dir: Path, steps: int, data: str, backend: str) -> dict:
    """nanoGPT's GPU shakespeare-char model size (6 x 384, block 256, batch 64) with bf16 autocast and
    torch.compile; the step times after the first 10 steps (compilation) give tokens/s."""
    from mini_transformer import TransformerConfig
    from mini_transformer.training import TrainConfig, train

    model_cfg = TransformerConfig.from_preset("shakespeare-char", d_model=384, n_heads=6, n_layer=6,
                                              max_seq_len=256, attn_backend=backend)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(data=data, batch_size=64, block_size=256, max_steps=steps, lr=1e-3, min_lr=1e-4,
                          warmup_steps=min(20, steps // 4), eval_interval=steps, eval_batches=10, device="cuda",
                          precision="bf16", compile=True, out_dir=tmp, num_samples=0, progress=False)
        result = train(cfg, model_cfg)
        if (Path(tmp) / "loss.png").exists():
            shutil.copy(Path(tmp) / "loss.png", out_dir / "train_loss.png")
    warm = result.step_times[10:] or result.step_times
    ms = 1e3 * statistics.median(warm)
    first, last = statistics.mean(result.losses[:10]), statistics.mean(result.losses[-10:])
    return dict(steps=result.step, data=data, backend=backend, first_step_s=result.step_times[0], ms_per_step=ms,
                tokens_per_s=result.tokens_per_step / (ms / 1e3), loss_first10=first, loss_last10=last,
                val_loss=result.evals[-1][2] if result.evals else math.nan,
                loss_falls=math.isfinite(last) and last <= 0.75 * first)


def train_markdown(r: dict) -> str:
    return "\n".join([
        "| steps | data | attention | first step s (compile) | ms/step | tokens/s | loss, first 10 | "
        "loss, last 10 | val loss |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
        f"| {r['steps']} | {r['data']} | {r['backend']} | {r['first_step_s']:.1f} | {r['ms_per_step']:.2f} | "
        f"{r['tokens_per_s']:,.0f} | {r['loss_first10']:.3f} | {r['loss_last10']:.3f} | {r['val_loss']:.3f} |",
    ])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("worker", choices=["errors", "train"])
    p.add_argument("--out-dir", default="out", help="train: where train_loss.png goes")
    p.add_argument("--steps", type=int, default=300, help="train: optimizer steps")
    p.add_argument("--data", default="pydoc", help="train: pydoc (ships with Python, no network) | shakespeare | PATH")
    p.add_argument("--backend", default="sdpa", help="train: the attention backend")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("_gpu_check_workers needs a CUDA device")
    if args.worker == "errors":
        rows = attention_errors()
        print(errors_markdown(rows))
        print(json.dumps(dict(rows=rows, ok=all(r["ok"] for r in rows))))
    else:
        out_dir = Path(args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        result = train_run(out_dir, args.steps, args.data, args.backend)
        print(train_markdown(result))
        print(json.dumps(result))


if __name__ == "__main__":
    main()
