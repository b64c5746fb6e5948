"""How much time and memory does attention take as T grows: naive vs SDPA vs tiled (vs Triton on CUDA)?

    python benchmarks/bench_attention.py                    # T = 256 .. 8192, B=1, H=8, D=64, causal, fp32, CPU
    python benchmarks/bench_attention.py --quick --plot     # T = 256 .. 1024, fewer repeats, PNGs in out/
    python benchmarks/bench_attention.py --device cuda --dtype bf16 --plot   # adds triton and TFLOP/s
    python benchmarks/bench_attention.py --device cuda --dtype bf16 --seq-lens 1024,4096,16384 --sdpa-kernel flash

Every (backend, T, mode) case runs in a FRESH subprocess, so one case's allocations cannot hide in
another's peak. Peak memory is the peak extra memory of the first call, inputs excluded:
  * CPU: the process's resident-set high-water mark (VmHWM in /proc/self/status) is reset by writing
    "5" to /proc/self/clear_refs just before the call; peak = VmHWM after the call - RSS before it.
    (Where clear_refs cannot be written, ru_maxrss is used instead, which includes start-up peaks.)
  * CUDA: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus the memory before.
Time is the median over repeated calls: on the CPU a host clock around each call; on CUDA a pair of CUDA
events around each call with no host synchronisation in between, so the GPU's time is measured, not the
launch latency (--sdpa-kernel flash makes sdpa use PyTorch's flash kernel only, or fail saying why).
A backend whose memory, extrapolated as T^2 from the last T it ran at (for naive's first T: counted
as 3.2 live T x T matrices, as measured), would pass --mem-limit-gb is skipped at that T: naive at
T=8192 needs about 6 GB, forward or forward+backward.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
MODES = ("fwd", "fwd+bwd")


# ---------------------------------------------------------------------------------- the worker
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes(reset_worked: bool) -> int:
    if reset_worked:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_case(backend: str, T: int, mode: str, args) -> dict:
    """Measure one case in this process: peak extra memory of the first call, then the median time."""
    import torch
    from _common import time_calls

    from mini_transformer.attention import attention

    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, DTYPES[args.dtype])
    B, H, D = args.batch, args.heads, args.head_dim

    def make(T):
        q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=mode != "fwd")
                   for _ in range(3))
        return q, k, v, torch.randn(B, H, T, D, device=device, dtype=dtype)

    kernels = contextlib.nullcontext
    if backend == "sdpa" and args.sdpa_kernel == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernels = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # noqa: E731

    def step(q, k, v, grad_out):
        with kernels():
            if mode == "fwd":
                with torch.no_grad():
                    attention(q, k, v, causal=True, backend=backend)
            else:
                attention(q, k, v, causal=True, backend=backend).backward(grad_out)
                q.grad = k.grad = v.grad = None

    step(*make(64))  # load kernels and libraries before measuring anything (and compile triton)
    inputs = make(T)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(*inputs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        before, reset = _rss_bytes(), _reset_peak_rss()
        step(*inputs)
        peak = _peak_rss_bytes(reset) - before
    # step() picks its own grad mode (no_grad for "fwd"), the same for the warm-up above and every timed call
    timing = time_calls(lambda: step(*inputs), repeats=args.min_repeats, warmup=0, device=device, grad="grad",
                        seconds=args.seconds, max_repeats=args.max_repeats)
    return dict(backend=backend, T=T, mode=mode, ms=timing.ms, peak_mb=max(peak, 0) / 2**20, runs=len(timing.times))


# ---------------------------------------------------------------------------------- the parent
def causal_flops(T: int, mode: str, args) -> float:
    """Useful FLOPs of causal attention: 2 matmuls of 2*T*T*D each, half of them below the diagonal;
    the backward has 5 such matmuls (2.5x the forward)."""
    forward = 4 * args.batch * args.heads * T * T * args.head_dim / 2
    return forward * (1.0 if mode == "fwd" else 3.5)


def spawn(backend: str, T: int, mode: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", backend, str(T), mode, *args.passthrough]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))  # the same interpreter: the installed package
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return dict(backend=backend, T=T, mode=mode, error=done.stderr.strip().splitlines()[-1:] or ["failed"])
    return json.loads(done.stdout.strip().splitlines()[-1])


def sweep(args) -> list[dict]:
    from tqdm import tqdm

    Ts = args.seq_lens or [T for T in (256, 512, 1024, 2048, 4096, 8192) if args.min_T <= T <= args.max_T]
    cases = [(mode, T, b) for mode in MODES for T in Ts for b in args.backends]
    results, last_peak = [], {}
    for mode, T, backend in tqdm(cases, desc="attention cases", unit="case"):
        predicted_gb = None
        if (mode, backend) in last_peak:
            peak_mb, at_T = last_peak[mode, backend]
            predicted_gb = peak_mb * (T / at_T) ** 2 / 1024
        elif backend == "naive":  # a little over 3 T x T matrices alive at once (measured)
            predicted_gb = 3.2 * args.batch * args.heads * T * T * 4 / 2**30
        if predicted_gb is not None and predicted_gb > args.mem_limit_gb:
            results.append(dict(backend=backend, T=T, mode=mode,
                                skipped=f"~{predicted_gb:.1f} GB > --mem-limit-gb {args.mem_limit_gb:g}"))
            continue
        row = spawn(backend, T, mode, args)
        if "ms" in row:
            last_peak[mode, backend] = (row["peak_mb"], T)
            if args.device == "cuda":
                row["tflops"] = causal_flops(T, mode, args) / (row["ms"] / 1e3) / 1e12
        results.append(row)
        save_json(results, args)  # after every case, so that a run stopped halfway still leaves its rows
    return results


def save_json(results: list[dict], args) -> None:
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def print_table(results: list[dict], args) -> None:
    naive = {(r["mode"], r["T"]): r for r in results if r["backend"] == "naive" and "ms" in r}
    cols = f"{'mode':8} {'T':>5} {'backend':8} {'time ms':>10} {'x naive':>8} {'peak MB':>10} {'x naive':>8}"
    print(f"\nB={args.batch} H={args.heads} D={args.head_dim} causal {args.dtype} on {args.device}, "
          f"{args.threads} thread(s); 'x naive' = this / naive (lower is better)"
          + ("; sdpa = its flash kernel" if args.sdpa_kernel == "flash" else ""))
    print(cols + ("  TFLOP/s" if args.device == "cuda" else ""))
    print("-" * (len(cols) + (9 if args.device == "cuda" else 0)))
    for r in results:
        head = f"{r['mode']:8} {r['T']:>5} {r['backend']:8}"
        if "ms" not in r:
            print(f"{head} {'skipped: ' + r['skipped'] if 'skipped' in r else 'error: ' + r['error'][0]}")
            continue
        ref = naive.get((r["mode"], r["T"]))
        t_ratio = f"{r['ms'] / ref['ms']:8.3f}" if ref else f"{'-':>8}"
        m_ratio = f"{r['peak_mb'] / ref['peak_mb']:8.3f}" if ref and ref["peak_mb"] > 0 else f"{'-':>8}"
        line = f"{head} {r['ms']:10.2f} {t_ratio} {r['peak_mb']:10.1f} {m_ratio}"
        print(line + (f" {r['tflops']:8.2f}" if "tflops" in r else ""))


def plot(results: list[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Chinese labels need a CJK font (Debian: fonts-noto-cjk); without it only those glyphs are missing
    plt.rcParams["font.family"] = ["DejaVu Sans", "Noto Sans CJK SC"]
    os.makedirs(args.out_dir, exist_ok=True)
    mode_names = {"fwd": "前向 forward", "fwd+bwd": "前向+反向 forward+backward"}
    quantities = (("ms", "时间 time (ms)", "time"), ("peak_mb", "峰值额外内存 peak extra memory (MB)", "memory"))
    for key, label, name in quantities:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for ax, mode in zip(axes, MODES, strict=True):
            for backend in args.backends:
                rows = [r for r in results if r["backend"] == backend and r["mode"] == mode and "ms" in r]
                if rows:
                    ax.plot([r["T"] for r in rows], [max(r[key], 1e-3) for r in rows], marker="o", label=backend)
            ax.set(xscale="log", yscale="log", xlabel="序列长度 sequence length T",
                   title=f"因果 attention causal attention, {mode_names.get(mode, mode)}")
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel(label)
        axes[0].legend()
        fig.suptitle(f"B={args.batch} H={args.heads} D={args.head_dim} {args.dtype} {args.device}")
        fig.tight_layout()
        path = os.path.join(args.out_dir, f"attention_{name}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        print(f"wrote {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--min-T", type=int, default=256)
    p.add_argument("--max-T", type=int, default=8192)
    p.add_argument("--seq-lens", default=None, help="comma list of T to run instead of the powers of two "
                   "from --min-T to --max-T, e.g. 1024,4096,16384")
    p.add_argument("--sdpa-kernel", default="auto", choices=["auto", "flash"],
                   help="auto: PyTorch picks; flash: its flash kernel only (CUDA fp16/bf16)")
    p.add_argument("--backends", default=None, help="comma list; default naive,sdpa,tiled (+triton on cuda)")
    p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1), help="torch CPU threads")
    p.add_argument("--seconds", type=float, default=2.0, help="time budget for the timed repeats of one case")
    p.add_argument("--min-repeats", type=int, default=3)
    p.add_argument("--max-repeats", type=int, default=20)
    p.add_argument("--mem-limit-gb", type=float, default=6.0, help="skip a case predicted to need more")
    p.add_argument("--quick", action="store_true", help="T up to 1024 and short timing (a smoke test)")
    p.add_argument("--plot", action="store_true", help="write attention_time.png and attention_memory.png")
    p.add_argument("--out-dir", default="out", help="where --plot writes its PNGs")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--worker", nargs=3, metavar=("BACKEND", "T", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.max_T, args.seconds, args.min_repeats = min(args.max_T, 1024), 0.5, 2
    if args.backends is None:
        args.backends = "naive,sdpa,tiled" + (",triton" if args.device == "cuda" else "")
    args.backends = args.backends.split(",")
    for name, value in (("--threads", args.threads), ("--batch", args.batch), ("--heads", args.heads),
                        ("--head-dim", args.head_dim), ("--min-repeats", args.min_repeats)):
        if value <= 0:
            p.error(f"{name}={value} must be a positive integer")
    if args.min_T > args.max_T:
        p.error(f"--min-T={args.min_T} is larger than --max-T={args.max_T}")
    if args.seq_lens is not None:
        try:
            args.seq_lens = [int(T) for T in args.seq_lens.split(",")]
        except ValueError:
            p.error(f"--seq-lens={args.seq_lens} must be a comma list of integers")
        if any(T <= 0 for T in args.seq_lens):
            p.error(f"--seq-lens={args.seq_lens} must be positive integers")
    args.passthrough = [f"--device={args.device}", f"--dtype={args.dtype}", f"--batch={args.batch}",
                        f"--heads={args.heads}", f"--head-dim={args.head_dim}", f"--threads={args.threads}",
                        f"--seconds={args.seconds}", f"--min-repeats={args.min_repeats}",
                        f"--max-repeats={args.max_repeats}", f"--sdpa-kernel={args.sdpa_kernel}"]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        backend, T, mode = args.worker
        print(json.dumps(run_case(backend, int(T), mode, args)))
        return
    results = sweep(args)
    print_table(results, args)
    save_json(results, args)
    if args.plot:
        plot(results, args)


if __name__ == "__main__":
    main()
