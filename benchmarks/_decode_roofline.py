"""The roofline of batch-1 decoding, for bench_decode_speed.py: the machine's memory bandwidth, the bytes
one decode step reads, and the plot of tokens/s against bytes per token under the ceiling
bandwidth / bytes per token."""

from __future__ import annotations

import glob
import time
from pathlib import Path

import torch
import torch.nn as nn
from _common import synchronize

from mini_transformer import TransformerConfig
from mini_transformer.model import huge_pages
from mini_transformer.model.layers import RMSNorm
from mini_transformer.model.quantize import Int4Linear, Int8Linear


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size in bytes, as Linux reports it (0 where it does not)."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = Path(path).read_text().strip()
        sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text))
    return max(sizes, default=0)


def measure_bandwidth(device: str = "cpu", mbytes: int | None = None, repeats: int = 5,
                      huge: bool = True) -> tuple[float, float]:
    """(copy, read) bytes per second over a tensor of `mbytes` MB on `device` (on the CPU by default 4x the
    last-level cache and at least 256 MB, so the figure is memory's, not the cache's), each the best of
    `repeats`, at the current thread count. copy = dst.copy_(src), counted as read + write; read =
    src.sum(), reading only, as a decode step reads its weights. The ceiling uses the read figure. On the CPU
    both tensors sit in 2 MB pages where the OS gives them (model/huge_pages.py), as the decode's weights do;
    huge=False leaves them in the allocator's 4 KB pages."""
    if mbytes is None:
        mbytes = max(256, 4 * last_level_cache_bytes() // 2**20) if device == "cpu" else 256
    n = mbytes * 2**20 // 4
    if device == "cpu" and huge and huge_pages.available():  # in 2 MB pages, as a CPU decode step's weights are
        src = huge_pages.huge_page_empty((n,), torch.float32).fill_(1)
        dst = huge_pages.huge_page_empty((n,), torch.float32)
    else:
        src = torch.ones(n, device=device)
        dst = torch.empty_like(src)
    best_copy = best_read = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best_copy = min(best_copy, time.perf_counter() - start)
        start = time.perf_counter()
        src.sum()
        synchronize(device)
        best_read = min(best_read, time.perf_counter() - start)
    return 2 * src.nbytes / best_copy, src.nbytes / best_read


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear (quantized or not, scales included), every
    norm, and one row of each embedding table (a tied head is counted once, as the head)."""
    layers = (nn.Linear, Int8Linear, Int4Linear, nn.LayerNorm, RMSNorm)
    total = sum(t.nbytes for m in model.modules() if isinstance(m, layers) for t in m.state_dict().values())
    rows = 1 + (model.pos_emb is not None)
    return total + rows * model.config.d_model * model.tok_emb.weight.element_size()


def kv_bytes_per_slot(cfg: TransformerConfig, element_size: int = 4) -> int:
    return 2 * cfg.n_layer * cfg.n_kv_heads * cfg.d_head * element_size  # k and v, every layer


def plot_roofline(rows: list[dict], bandwidth: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["bytes"] for r in rows]
    span = torch.logspace(torch.log10(torch.tensor(min(xs) / 2)), torch.log10(torch.tensor(max(xs) * 2)), 50)
    ax.plot(span, bandwidth / span, "k--", label=f"ceiling: {bandwidth / 1e9:.1f} GB/s / bytes per token")
    for r in rows:
        marker = "o" if r["model"] == "char" else "s"
        ax.scatter(r["bytes"], r["tok_s"], marker=marker, label=f"{r['model']} {r['method']} ({r['share']:.0%})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes read per token")
    ax.set_ylabel("tokens / s")
    ax.set_title("batch-1 greedy decode against the memory-bandwidth ceiling")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")
