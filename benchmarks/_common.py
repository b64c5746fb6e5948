"""What every benchmark script shares: one timer, one set of common flags, one table with ratios.

    timing = time_calls(fn, repeats=5, device=args.device)           # Timing: .median, .min, .times
    timings = time_interleaved({"a": fa, "b": fb}, repeats=5)         # A B A B ...: load hits both alike
    print(table(rows, {"method": "method", "ms": "ms"}, ratio=("ms", "plain")))

The timer warms up and times in ONE grad mode (`grad="inference" | "no_grad" | "grad"`): a compiled
function guards on it, so a warm-up in another mode would leave the first timed call to recompile. The
device is synchronised around every timed call (CUDA work is asynchronous). Both the median (the
figure tables report) and the minimum (the least disturbed run, on a shared machine) are kept.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

GRAD_MODES = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "grad": contextlib.nullcontext}

# The 124.7M Llama of vs_llama_cpp.py in our config's names (vs_llama_cpp.py writes the same layout for Hugging Face):
# 768 hidden, 12 layers, GQA 12/4, SwiGLU 2048, vocab 32000, untied head
LLAMA_124M = dict(vocab_size=32000, d_model=768, n_heads=12, n_kv_heads=4, n_layer=12, d_ff=2048, max_seq_len=1024,
                  pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False, tie_weights=False, attn_backend="sdpa")


def load_average() -> str:
    """The 1-minute load average, for a table's heading: figures from a busy machine say so."""
    return f"load {os.getloadavg()[0]:.2f}"


@dataclass
class Timing:
    """Seconds of each timed call."""

    times: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def ms(self) -> float:
        """The median in milliseconds (what the tables report)."""
        return 1000 * self.median


def synchronize(device: str | torch.device) -> None:
    """Wait for queued device work (a host clock around an asynchronous CUDA call measures nothing)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], device: str | torch.device = "cpu") -> tuple[object, float]:
    """(fn's result, seconds) of one call, the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def time_interleaved(functions: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 1,
                     device: str | torch.device = "cpu", grad: str = "inference") -> dict[str, Timing]:
    """Warm each function up `warmup` times, then call them in turns (A B A B ...) `repeats` times each,
    all under one grad mode. Returns a Timing per name."""
    with GRAD_MODES[grad]():
        for fn in functions.values():
            for _ in range(warmup):
                fn()
        times: dict[str, list[float]] = {name: [] for name in functions}
        for _ in range(repeats):
            for name, fn in functions.items():
                times[name].append(time_call(fn, device)[1])
    return {name: Timing(t) for name, t in times.items()}


def time_calls(fn: Callable[[], object], *, repeats: int, warmup: int = 1, device: str | torch.device = "cpu",
               grad: str = "inference", seconds: float = 0.0, max_repeats: int | None = None) -> Timing:
    """One function: `warmup` calls, then at least `repeats` timed calls, in one grad mode; with a time
    budget (`seconds`), more calls while it lasts, up to `max_repeats`."""
    with GRAD_MODES[grad]():
        for _ in range(warmup):
            fn()
        times: list[float] = []
        deadline = time.perf_counter() + seconds
        while len(times) < repeats or (time.perf_counter() < deadline and len(times) < (max_repeats or repeats)):
            times.append(time_call(fn, device)[1])
    return Timing(times)


# ------------------------------------------------------------------------------------------- flags
def add_common_args(parser: argparse.ArgumentParser, *, threads: int | None = None, device: bool = True,
                    plot: str | None = "write the figure to this PNG", out: str | None = None) -> None:
    """--threads (torch CPU threads; default `threads`, else every core), --device, --plot PNG and, when
    `out` names what it holds, --out. A script leaves out (device=False, plot=None) what it has no use for."""
    default_threads = threads if threads is not None else os.cpu_count() or 1
    parser.add_argument("--threads", type=int, default=default_threads, help="torch CPU threads")
    if device:
        parser.add_argument("--device", default="cpu", help="cpu | cuda")
    if plot is not None:
        parser.add_argument("--plot", metavar="PNG", help=plot)
    if out is not None:
        parser.add_argument("--out", default=None, help=out)


def add_serving_args(parser: argparse.ArgumentParser, *, max_len: int, requests_help: str | None = None) -> None:
    """The serving benchmarks' workload (--requests, --min-len, --max-len) and engine (--block-size,
    --max-num-seqs, --max-num-batched-tokens) flags, with the engine's defaults."""
    parser.add_argument("--requests", type=int, default=64, help=requests_help)
    parser.add_argument("--min-len", type=int, default=16, help="shortest prompt and output")
    parser.add_argument("--max-len", type=int, default=max_len, help="longest prompt and output")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)


def apply_common_args(args: argparse.Namespace) -> None:
    """What the common flags set up before anything is measured."""
    torch.set_num_threads(args.threads)


# ------------------------------------------------------------------------------------------- table
def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def table(rows: list[dict], columns: dict[str, str], *, ratio: tuple[str, str] | None = None,
          ratio_title: str = "vs ref", higher_is_better: bool = False) -> str:
    """A Markdown table of `rows` (dicts); `columns` maps a row key to its column title. `ratio=(key,
    label)` adds a column: each row's `key` against the row whose first column is `label` (measured in the
    same run), written so that > 1 means better than the reference (faster, or more tokens/s)."""
    keys = list(columns)
    titles = [columns[k] for k in keys] + ([ratio_title] if ratio else [])
    reference = next(row[ratio[0]] for row in rows if row[keys[0]] == ratio[1]) if ratio else None
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    for row in rows:
        cells = [_cell(row.get(k, "")) for k in keys]
        if ratio:
            value = row[ratio[0]]
            cells.append(f"{(value / reference if higher_is_better else reference / value):.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
