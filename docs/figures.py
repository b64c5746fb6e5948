"""Draw the docs' concept figures (Chinese labels) into docs/img/, and redraw the benchmark figures from the
tables measured on the pages (so a figure and its table cannot disagree). Rerun after changing either:

    apt-get install -y fonts-noto-cjk        # Debian's CJK font; the labels need it
    uv run python docs/figures.py             # every figure
    uv run python docs/figures.py systems     # only the 06-13 figures (figures_systems.py, figures_cluster.py)

Concept figures: the block with its tensor shapes (01), RoPE turning one pair across positions (02), the
KV slab with left padding and one decode step (03), the online-softmax rescale across two blocks and the
tiled schedule of which QK^T blocks are computed, masked or skipped (04); the systems stages' figures
(06-10: block pool, hash chain, batching timeline, packed step, request path, roofline, speculative step,
MoE dispatch, tensor parallelism, pipeline bubble, PD flow) are in figures_systems.py, and docs/13's replicas
behind a router and PD across servers in figures_cluster.py.

Fonts: the first CJK font matplotlib can find among CJK_FONTS (`fc-list :lang=zh` lists what is
installed). With none, the script says how to install one and exits without touching docs/img/, rather
than writing figures whose labels are empty boxes.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import font_manager  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle  # noqa: E402

CJK_FONTS = ("Noto Sans CJK SC", "Noto Serif CJK SC", "Source Han Sans SC", "WenQuanYi Zen Hei", "AR PL UMing CN")
CJK_FONT = CJK_FONTS[0]  # set by use_cjk_font() to the one found
DOCS = Path(__file__).resolve().parent
IMG = DOCS / "img"
BLUE, ORANGE, GREY, GREEN, YELLOW = "#4c72b0", "#dd8452", "#bbbbbb", "#55a868", "#f2d16b"


def find_cjk_font() -> str | None:
    """The first of CJK_FONTS that matplotlib can load, or None."""
    for attempt in range(2):
        for name in CJK_FONTS:
            try:
                font_manager.findfont(name, fallback_to_default=False)
                return name
            except ValueError:
                continue
        if not attempt:  # installed after matplotlib cached its font list: add the system's CJK files to it
            for path in font_manager.findSystemFonts():
                if "CJK" in Path(path).name or "wqy" in Path(path).name.lower():
                    font_manager.fontManager.addfont(path)
    return None


def use_cjk_font() -> None:
    global CJK_FONT
    found = find_cjk_font()
    if found is None:
        sys.exit(f"no CJK font found (tried {', '.join(CJK_FONTS)}; see `fc-list :lang=zh`): "
                 "apt-get install -y fonts-noto-cjk, then rerun. docs/img/ was left as it is.")
    CJK_FONT = found
    plt.rcParams["font.family"] = ["DejaVu Sans", CJK_FONT]  # Latin from DejaVu, the rest from the CJK font
    plt.rcParams["axes.unicode_minus"] = False


def save(fig, name: str) -> None:
    fig.savefig(IMG / name, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote docs/img/{name}")


# ------------------------------------------------------------------------------------------ 01
def block_shapes() -> None:
    """The data flow of one forward pass, every box labelled with its tensor shape."""
    steps = [  # (label, shape, colour); None marks where the repeated block starts / ends
        ("token ids", "(B, T) 整数", "white"),
        ("词嵌入 tok_emb + 位置嵌入 pos_emb", "(B, T, C)", "#dde8f5"),
        None,
        ("norm_1（LayerNorm / RMSNorm）", "(B, T, C)", "#eeeeee"),
        ("W_qkv：一次投影出 q、k、v", "(B, T, (H + 2·Hkv)·D)", "#dde8f5"),
        ("拆成多头：view + transpose + split", "q (B, H, T, D)；k、v (B, Hkv, T, D)", "#dde8f5"),
        ("分数 q kᵀ / √D，加因果掩码", "(B, H, T, T)", "#fbe3d3"),
        ("softmax，再乘 v", "(B, H, T, D)", "#fbe3d3"),
        ("合并头 + W_o，加回残差", "(B, T, C)", "#dde8f5"),
        ("norm_2 → FFN 升维 → 激活 → 降维，加回残差", "(B, T, d_ff) → (B, T, C)", "#e3f1e3"),
        None,
        ("norm_f → lm_head", "(B, T, V)：每个位置对词表里每个 token 的 logit", "#dde8f5"),
    ]
    fig, ax = plt.subplots(figsize=(9.6, 7.6))
    ax.set_axis_off()
    y, box_h, gap = 0.0, 0.62, 0.28
    top = bottom = None
    for step in steps:
        if step is None:
            if top is None:
                top = y + gap / 2
            else:
                bottom = y + gap / 2
            continue
        label, shape, colour = step
        ax.add_patch(FancyBboxPatch((0, y - box_h), 7.6, box_h, boxstyle="round,pad=0.02", fc=colour, ec="black"))
        ax.text(0.15, y - box_h / 2, label, va="center", fontsize=10)
        ax.text(7.9, y - box_h / 2, shape, va="center", fontsize=9.5, family=["DejaVu Sans Mono", CJK_FONT],
                color="#333333")
        if step is not steps[-1]:
            ax.annotate("", (3.8, y - box_h - gap + 0.02), (3.8, y - box_h), arrowprops=dict(arrowstyle="->"))
        y -= box_h + gap
    ax.add_patch(Rectangle((-0.25, bottom), 8.1, top - bottom, fill=False, ls="--", ec="#888888"))
    ax.text(-0.35, (top + bottom) / 2, "× n_layer\n（pre-norm 块）", ha="right", va="center", fontsize=10)
    ax.set_xlim(-2.6, 14.8)
    ax.set_ylim(y - 0.1, 0.15)
    ax.set_title("一次前向：每一步的张量形状\n（B 批大小，T 序列长，C = d_model，H 头数，D = d_head，V 词表）",
                 fontsize=10.5)
    save(fig, "01-block-shapes.png")


# ------------------------------------------------------------------------------------------ 02
def rope_rotation(D: int = 16, theta: float = 10000.0) -> None:
    """Pair i of a head's vector turns by m * theta_i at position m: a fast pair and a slow one."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.4))
    x = np.array([1.0, 0.35])
    for ax, i in zip(axes[:2], (0, 2), strict=True):
        theta_i = theta ** (-2 * i / D)
        positions = range(8)  # the same eight positions: the slow pair barely turns
        ax.add_patch(plt.Circle((0, 0), np.linalg.norm(x), fill=False, ls=":", ec=GREY))
        for m in positions:
            a = m * theta_i
            rot = np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]]) @ x
            ax.annotate("", rot, (0, 0), arrowprops=dict(arrowstyle="->", color=plt.cm.viridis(m / max(positions))))
            ax.text(*(rot * 1.13), f"m={m}", ha="center", va="center", fontsize=8)
        ax.set(xlim=(-1.35, 1.35), ylim=(-1.35, 1.35), aspect="equal", xticks=[], yticks=[])
        ax.set_title(f"第 i={i} 对维度 (x_{i}, x_{i + D // 2})：θ_{i} = {theta_i:.3g}\n"
                     f"位置 m 处转过 m·θ_{i} 弧度", fontsize=10)
    # the score of q at position m and k at position m + 3 stays the same as both move together
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal(D), rng.standard_normal(D)
    freqs = theta ** (-2 * np.arange(D // 2) / D)

    def rope(v, m):
        a, b = v[: D // 2], v[D // 2:]
        c, s = np.cos(m * freqs), np.sin(m * freqs)
        return np.concatenate([a * c - b * s, b * c + a * s])

    ms = np.arange(0, 40)
    axes[2].plot(ms, [rope(q, m) @ rope(k, m + 3) for m in ms], "o-", ms=3, color=BLUE,
                 label="相距 3：q 在 m，k 在 m+3")
    axes[2].plot(ms, [rope(q, m) @ rope(k, 2 * m) for m in ms], "s-", ms=3, color=ORANGE, label="相距 m：k 在 2m")
    axes[2].set(xlabel="位置 m", ylabel="分数 (R_m q)·(R_n k)")
    axes[2].set_title("分数只取决于相对距离 n − m", fontsize=10)
    axes[2].legend(fontsize=8)
    axes[2].grid(alpha=0.3)
    fig.suptitle(f"RoPE（rotate-half 布局，D = {D}，rope_theta = {theta:g}）：只转 q 和 k，从不转 v", fontsize=11)
    fig.tight_layout()
    save(fig, "02-rope-rotation.png")


# ------------------------------------------------------------------------------------------ 03
def kv_slab(max_len: int = 11) -> None:
    """One layer and head of the cache (B, max_len): left padding, the prompt, decoded tokens, the next write."""
    prompts, n_decoded, width = [5, 3, 6], 3, 6  # prompt lengths; decode steps done; padded prompt width
    fig, ax = plt.subplots(figsize=(11, 3.6))
    for b, n in enumerate(prompts):
        row = len(prompts) - 1 - b
        for t in range(max_len):
            pad = width - n
            if t < pad:
                colour, text = GREY, "填充"
            elif t < width:
                colour, text = BLUE, str(t - pad)
            elif t < width + n_decoded:
                colour, text = ORANGE, str(t - pad)
            elif t == width + n_decoded:
                colour, text = "#fff2cc", str(t - pad)
            else:
                colour, text = "white", ""
            ax.add_patch(Rectangle((t, row), 0.95, 0.9, fc=colour, ec="black", lw=0.6))
            ax.text(t + 0.47, row + 0.45, text, ha="center", va="center", fontsize=8.5,
                    color="white" if colour in (BLUE, ORANGE) else "black")
        ax.text(-0.3, row + 0.45, f"第 {b} 行（提示 {n} 个 token）", ha="right", va="center", fontsize=9)
    col = width + n_decoded
    ax.add_patch(Rectangle((col - 0.05, -0.1), 1.05, len(prompts) + 0.1, fill=False, ec="red", lw=2))
    ax.annotate("decode 这一步：每行的新 k、v 写进同一列\n新 query 看这一行所有非填充的 key", (col + 1.05, 1.5),
                (col + 1.6, 1.5), fontsize=9, va="center", arrowprops=dict(arrowstyle="->", color="red"))
    legend = [Patch(fc=colour, ec="black", label=label) for colour, label in (
        (GREY, "填充（key 被掩码挡住）"), (BLUE, "prefill 写入的提示"), (ORANGE, "之前 decode 写入的"),
        ("#fff2cc", "这一步写入"), ("white", "预分配、还没用"))]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=5, fontsize=8.5, frameon=False)
    ax.set(xlim=(-5.5, max_len + 5.5), ylim=(-0.2, len(prompts) + 0.1), xticks=[], yticks=[])
    ax.set_axis_off()
    ax.set_title("KV cache 的一层一头：(B, max_len) 个槽位，左侧填充；\n格子里的数字是位置编号（只数真实 token）",
                 fontsize=10)
    save(fig, "03-kv-cache-slab.png")


# ------------------------------------------------------------------------------------------ 04
def online_softmax() -> None:
    """One row of 8 scores in two key blocks: block 1 summed under its own max, rescaled by alpha later."""
    s = np.array([1.0, 2.5, 0.5, 1.5, 3.0, 4.0, 2.0, 0.2])
    b1, b2 = s[:4], s[4:]
    m1, m = b1.max(), s.max()
    alpha = math.exp(m1 - m)
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 4.2))
    axes[0].bar(range(4), b1, color=BLUE, label="块 1 的分数")
    axes[0].bar(range(4, 8), b2, color=ORANGE, label="块 2 的分数")
    axes[0].axhline(m1, color=BLUE, ls="--", lw=1, label=f"m₁ = 块 1 的最大值 {m1:g}")
    axes[0].axhline(m, color=ORANGE, ls="--", lw=1, label=f"m = 整行的最大值 {m:g}")
    axes[0].set_title("一行分数，分成两个 key 块", fontsize=10)
    axes[1].bar(np.arange(4) - 0.2, np.exp(b1 - m1), 0.4, color=BLUE, alpha=0.5, label="看完块 1 时：exp(s − m₁)")
    axes[1].bar(np.arange(4) + 0.2, alpha * np.exp(b1 - m1), 0.4, color=BLUE,
                label=f"乘以 α = exp(m₁ − m) = {alpha:.3f}")
    axes[1].bar(range(4, 8), np.exp(b2 - m), color=ORANGE, label="块 2：exp(s − m)")
    axes[1].plot(range(8), np.exp(s - m), "k_", ms=18, mew=2, label="一次算完整行：exp(s − m)")
    axes[1].set_title("块 1 的旧值只差一个因子 α：修正后与整行一次算出的相同", fontsize=10)
    l1 = np.exp(b1 - m1).sum()
    l2 = np.exp(b2 - m).sum()
    parts = {"l₁（块 1，按 m₁）": l1, "α·l₁": alpha * l1, "l₂（块 2，按 m）": l2,
             "α·l₁ + l₂": alpha * l1 + l2, "Σ exp(s − m) 一次算完": np.exp(s - m).sum()}
    axes[2].barh(list(parts), list(parts.values()), color=[BLUE, BLUE, ORANGE, GREEN, "black"])
    axes[2].invert_yaxis()
    axes[2].set_title("分母 l = α·l + rowsum(p)：丢掉 α，l₁ 就多算了", fontsize=10)
    for ax in axes[:2]:
        ax.set_xticks(range(8), [f"k{j}" for j in range(8)])
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("online softmax：逐块累加，遇到更大的最大值时把旧的和乘以 α（分子 acc 同样处理）", fontsize=11)
    fig.tight_layout()
    save(fig, "04-online-softmax.png")


def tiled_schedule() -> None:
    """Which (query block, key block) pairs of QK^T the causal tiled loop computes, masks or skips."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw=dict(width_ratios=[1, 1.6]))
    for ax, (nq, nk, title) in zip(axes, ((4, 4, "prefill：Tq = Tk（8 个 token，块大小 2）"),
                                          (2, 6, "分块 prefill：4 个新 query 接在 8 个旧 key 后面（Tq < Tk）")),
                                   strict=True):
        offset = nk - nq  # queries sit at the end of the keys (in blocks here)
        for i in range(nq):
            for j in range(nk):
                if j < i + offset:
                    colour, text = GREEN, "全算"
                elif j == i + offset:
                    colour, text = YELLOW, "块内\n因果掩码"
                else:
                    colour, text = "white", "跳过"
                ax.add_patch(Rectangle((j, nq - 1 - i), 0.96, 0.96, fc=colour, ec="black", lw=0.8))
                ax.text(j + 0.48, nq - 1 - i + 0.48, text, ha="center", va="center", fontsize=8.5,
                        color="#999999" if text == "跳过" else "black")
        ax.set(xlim=(0, nk), ylim=(0, nq), aspect="equal")
        ax.set_xticks(np.arange(nk) + 0.48, [f"k 块 {j}" for j in range(nk)], fontsize=8)
        ax.set_yticks(np.arange(nq) + 0.48, [f"q 块 {i}" for i in reversed(range(nq))], fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.suptitle("FlashAttention 的分块调度：QKᵀ 的哪些块要算、哪些块要掩码、哪些块从不读取", fontsize=11)
    fig.tight_layout()
    save(fig, "04-tiled-schedule.png")


# ------------------------------------------------------------------------------------------ 11
def kv_store_replicas() -> None:
    """Two serving replicas and the shared store: A saves full blocks, B loads the prefix instead of computing it."""
    fig, ax = plt.subplots(figsize=(10.5, 4.6))
    ax.set_axis_off()

    def box(x, y, w, h, colour, title):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.15", fc=colour,
                                    ec="black", lw=0.8))
        ax.text(x + w / 2, y + h - 0.25, title, ha="center", va="top", fontsize=9.5)

    def blocks(x, y, colours, labels=None):
        for i, colour in enumerate(colours):
            ax.add_patch(Rectangle((x + 0.42 * i, y), 0.38, 0.38, fc=colour, ec="black", lw=0.5))
            if labels:
                ax.text(x + 0.42 * i + 0.19, y + 0.19, labels[i], ha="center", va="center", fontsize=7)

    for x, name, prefix_colour, note in ((0.0, "副本 A（先收到请求）", BLUE, "算了整段 prompt"),
                                         (7.0, "副本 B（后收到同前缀的请求）", YELLOW, "前缀从 Redis 载入，只算尾巴")):
        box(x, 0.4, 3.6, 3.7, "#f4f4f4", name)
        ax.text(x + 0.2, 3.25, "设备上的块池（GPU 显存 / CPU 内存）", fontsize=8.5)
        blocks(x + 0.2, 2.7, [prefix_colour] * 4 + [ORANGE], ["0", "1", "2", "3", "尾"])
        ax.text(x + 0.2, 2.35, note, fontsize=8, color="#444444")
        ax.text(x + 0.2, 1.7, "HostTier：本进程内存里的 LRU", fontsize=8.5)
        blocks(x + 0.2, 1.15, [prefix_colour] * 4)
        ax.text(x + 0.2, 0.7, "KVConnector：lookup → load，save（写后台）", fontsize=8)
    box(4.0, 0.9, 2.6, 2.4, "#fdecea", "Redis（两个副本共用）")
    blocks(4.45, 1.9, [BLUE] * 4, ["0", "1", "2", "3"])
    ax.text(5.3, 1.3, "键 = 模型指纹 + 链式哈希\n值 = 各层 K/V + token id + 校验和", ha="center", fontsize=7.5)
    ax.annotate("", (4.1, 2.1), (3.6, 2.9), arrowprops=dict(arrowstyle="->", color=BLUE, lw=1.6))
    ax.text(5.3, 3.95, "save：A 把算完的满块写进去", fontsize=8.5, color=BLUE, ha="center")
    ax.annotate("", (7.0, 2.9), (6.5, 2.1), arrowprops=dict(arrowstyle="->", color="#c0392b", lw=1.6))
    ax.text(5.3, 3.6, "load：B 校验之后拷进自己的块池", fontsize=8.5, color="#c0392b", ha="center")
    legend = [Patch(fc=colour, ec="black", label=label) for colour, label in (
        (BLUE, "A 算出的前缀块"), (YELLOW, "B 从 Redis 载入的同一批块"), (ORANGE, "各自的尾巴（不同，本地计算）"))]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, 0.02), ncol=3, fontsize=8.5, frameon=False)
    ax.set(xlim=(-0.2, 10.8), ylim=(0.0, 4.3))
    ax.set_title("两个服务副本共用一个 KV 存储：查找顺序 块池 → 本机内存 → Redis，每次命中都先校验", fontsize=10)
    save(fig, "11-kv-store.png")


# ------------------------------------------------------------------- benchmark figures, from the pages' tables
def page_table(page: str, header_start: str) -> list[list[str]]:
    """The body rows of the first markdown table in docs/<page> whose header row starts with header_start."""
    lines = (DOCS / page).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("*") for c in line.strip("|").split("|")])
    return rows


def numbers(cell: str) -> list[float]:
    """'0.94 (0.18)' -> [0.94, 0.18]; '25,811' -> [25811.0]; bold marks are already stripped."""
    return [float(x.replace(",", "")) for x in re.findall(r"[\d.,]*\d", cell)]


def first_number(cell: str) -> float:
    return numbers(cell)[0]


def load_benchmark(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, DOCS.parent / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_benchmark_with_siblings(name: str):
    """A benchmark that imports its sibling modules (bench_roofline imports _decode_roofline)."""
    sys.path.insert(0, str(DOCS.parent / "benchmarks"))
    return load_benchmark(name)


def redraw_benchmark_figures() -> None:
    """The benchmarks' own plot functions, fed the numbers the pages report."""
    import tempfile
    from types import SimpleNamespace

    rows = page_table("03-kv-cache.md", "| 新 token 数")  # the first table: 2 threads, the plotted one
    lengths = [int(r[0]) for r in rows]
    tok_s = {(int(r[0]), m): first_number(r[i]) for r in rows for i, m in ((1, "cache"), (2, "no-cache"), (3, "hf"))}
    load_benchmark("bench_decode").plot(lengths, ["cache", "no-cache", "hf"], tok_s, "6x384 GPT-2, cpu",
                                        str(IMG / "03-kv-cache-decode.png"))

    modes = {"前向": "fwd", "前向+反向": "fwd+bwd"}
    results = [dict(backend=backend, mode=modes[r[0]], T=int(r[1]), ms=first_number(r[2 + i]),
                    peak_mb=first_number(r[5 + i]))
               for r in page_table("04-flash-attention.md", "| 模式 | T |")
               for i, backend in enumerate(("naive", "sdpa", "tiled"))]
    with tempfile.TemporaryDirectory() as tmp:
        args = SimpleNamespace(out_dir=tmp, backends=["naive", "sdpa", "tiled"], batch=1, heads=8, head_dim=64,
                               dtype="fp32", device="cpu")
        load_benchmark("bench_attention").plot(results, args)
        for name in ("time", "memory"):
            (Path(tmp) / f"attention_{name}.png").replace(IMG / f"04-attention-{name}.png")

    table = page_table("05-training.md", "| step | gpt2 val")
    names = ("gpt2", "gpt2-init002", "modern")
    runs = {name: dict(result=SimpleNamespace(evals=[(int(r[0]), numbers(r[1 + i])[1],
                                                      first_number(r[1 + i])) for r in table]))
            for i, name in enumerate(names)}
    load_benchmark("bench_train").plot(runs, [], str(IMG / "05-train-loss.png"))


def draw_systems_figures() -> None:
    import figures_cluster
    import figures_systems

    roofline = page_table("08a-static-decode.md", "| 测得的量")
    bandwidth, peak = first_number(roofline[0][1]) * 1e9, first_number(roofline[1][1]) * 1e9
    figures_systems.draw_all(save, (bandwidth, peak), load_benchmark_with_siblings("bench_roofline").step_cost)
    figures_cluster.cluster(save)


if __name__ == "__main__":
    use_cjk_font()
    IMG.mkdir(exist_ok=True)
    if sys.argv[1:] == ["systems"]:  # only the 06-13 figures
        draw_systems_figures()
        sys.exit(0)
    block_shapes()
    rope_rotation()
    kv_slab()
    online_softmax()
    tiled_schedule()
    kv_store_replicas()
    redraw_benchmark_figures()
    draw_systems_figures()
