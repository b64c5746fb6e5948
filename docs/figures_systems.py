"""Concept figures of the systems stages (docs/06-10), Chinese labels; docs/figures.py calls draw_all().

Where a figure shows a data structure, it is the real one: the block pool and block tables come from a
BlockManager with prefix caching, the continuous-batching timeline from the project's Scheduler stepping
a small workload, the packed step's four tensors and its mask from a tiny LLMEngine's Scheduler and
ModelRunner.prepare, the roofline from benchmarks/bench_roofline.py's step_cost and the bandwidth and FLOP/s
that docs/08a reports. The pipeline bubble is drawn from the GPipe formula (no measured pipeline timeline
exists in the repository yet).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import FancyArrowPatch, Rectangle

from mini_transformer import TransformerConfig
from mini_transformer.engine.block_manager import BlockManager
from mini_transformer.engine.scheduler import Scheduler
from mini_transformer.engine.sequence import Sequence
from mini_transformer.inference.sampling import SamplingParams

BLUE, ORANGE, GREY, GREEN, YELLOW = "#4c72b0", "#dd8452", "#bbbbbb", "#55a868", "#f2d16b"
PURPLE, RED = "#8172b2", "#c44e52"


def box(ax, x, y, w, h, text, fc="white", fontsize=9, **kw):
    ax.add_patch(Rectangle((x, y), w, h, fc=fc, ec="black", lw=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, **kw)


def arrow(ax, a, b, text="", color="black", fontsize=8.5, offset=(0, 0.12)):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="->", mutation_scale=12, color=color, lw=1.2))
    if text:
        ax.text((a[0] + b[0]) / 2 + offset[0], (a[1] + b[1]) / 2 + offset[1], text, ha="center", fontsize=fontsize,
                color=color)


def _seq(name, tokens, max_tokens=4, arrival=0):
    return Sequence(name, tokens, SamplingParams(max_tokens=max_tokens), (), arrival, torch.device("cpu"))


# ------------------------------------------------------------------------------------------ 06
def block_pool(save) -> None:
    """Two prompts sharing 8 tokens, in a real BlockManager (block_size 4, prefix caching on)."""
    manager = BlockManager(10, 4)
    a = _seq("A", [11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    b = _seq("B", [11, 12, 13, 14, 15, 16, 17, 18, 31, 32, 33])
    for seq in (a, b):
        cached = manager.find_cached_blocks(seq)
        manager.admit(seq, cached)
        manager.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
        seq.num_computed_tokens = seq.num_tokens
    owner = {}
    for seq, colour in ((a, BLUE), (b, ORANGE)):
        for i, block_id in enumerate(seq.block_table):
            owner.setdefault(block_id, []).append((seq, i, colour))
    fig, ax = plt.subplots(figsize=(11, 4.4))
    for block_id in range(manager.num_blocks):
        x, held = block_id * 1.05, owner.get(block_id, [])
        block = manager.blocks[block_id]
        colour = GREEN if len(held) > 1 else held[0][2] if held else "white"
        seq, i = (held[0][0], held[0][1]) if held else (None, 0)
        tokens = seq.tokens[i * 4:(i + 1) * 4] if seq else []
        slots = "\n".join(str(t) for t in tokens + ["·"] * (4 - len(tokens))) if seq else "空闲"
        box(ax, x, 0, 0.95, 2.2, slots, fc=colour, fontsize=8, color="white" if held else "black")
        ax.text(x + 0.47, -0.3, f"块 {block_id}", ha="center", fontsize=8)
        ax.text(x + 0.47, 2.35, f"引用 {block.ref_count}", ha="center", fontsize=7.5)
    for row, (seq, colour) in enumerate(((a, BLUE), (b, ORANGE))):
        y = 4.2 - row * 0.9
        ax.text(-0.2, y, f"序列 {seq.request_id} 的块表 {seq.block_table}（{seq.num_tokens} 个 token）", ha="left",
                fontsize=9.5, color=colour)
        for block_id in seq.block_table:
            arrow(ax, (block_id * 1.05 + 0.47, y - 0.15), (block_id * 1.05 + 0.47, 2.6), color=colour)
    ax.set(xlim=(-0.3, manager.num_blocks * 1.05), ylim=(-0.6, 4.6))
    ax.set_axis_off()
    ax.set_title("块池与块表（block_size = 4，前缀缓存开）：B 的前 8 个 token 命中 A 的两个满块（绿，引用计数 2），"
                 "\n只为自己的后缀拿新块；每个序列最多一个没填满的块（· 是空槽）", fontsize=10)
    save(fig, "06-block-pool.png")


def prefix_hash_chain(save) -> None:
    """hash(block i) = hash(hash(block i-1), tokens of block i): two prompts, equal for two blocks."""
    fig, ax = plt.subplots(figsize=(11, 3.6))
    prompts = (("提示 1", ["你 是 一 个", "助 手 。 请", "回 答 ："]),
               ("提示 2", ["你 是 一 个", "助 手 。 请", "翻 译 成"]))
    for row, (name, blocks) in enumerate(prompts):
        y = 2.0 - row * 1.6
        ax.text(-0.2, y + 0.35, name, ha="right", va="center", fontsize=10)
        for i, text in enumerate(blocks):
            x = i * 3.3
            full = i < 2
            fc = GREEN if full else (YELLOW if row == 0 else ORANGE)
            box(ax, x, y, 1.5, 0.7, text, fc=fc, fontsize=9)
            label = f"h{i} = hash(h{i - 1}, 块 {i})" if i else "h0 = hash(None, 块 0)"
            label = label if full else "不满的块：没有哈希"
            ax.text(x + 0.75, y - 0.22, label, ha="center", fontsize=8)
            if i:
                arrow(ax, (x - 1.8, y + 0.35), (x - 0.05, y + 0.35), "父哈希" if i < 2 else "", fontsize=7.5)
    ax.text(3.3 * 2 + 1.9, 1.2, "h0、h1 相同 → 前两块共享同一份 K/V\n（命中时还要核对 token 和父块，防哈希碰撞）",
            fontsize=9, va="center")
    ax.set(xlim=(-1.2, 11.5), ylim=(-0.2, 3.0))
    ax.set_axis_off()
    ax.set_title("前缀缓存的哈希链（block_size = 4）："
                 "哈希里含父块的哈希，所以相等的哈希意味着整个前缀相等", fontsize=10)
    save(fig, "06-prefix-hash-chain.png")


def _continuous_timeline(lengths, budget, block_size=4):
    """Run the project's Scheduler on requests (prompt length, max_tokens) all added at step 0; return, per
    step, [(name, tokens, is_prefill)]."""
    manager = BlockManager(64, block_size, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=budget)
    for i, (prompt, new) in enumerate(lengths):
        scheduler.add(_seq(f"R{i}", [1] * prompt, max_tokens=new, arrival=i))
    steps = []
    while scheduler.has_unfinished() and len(steps) < 40:
        out, row = scheduler.schedule(), []
        for seq, n in out.scheduled:
            row.append((seq.request_id, n, seq.num_computed_tokens < seq.num_prompt_tokens))
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(1)
                if seq.is_finished:
                    scheduler.finish(seq)
        steps.append(row)
    return steps


def batching_timeline(save) -> None:
    lengths = [(6, 3), (3, 8), (10, 4), (4, 2), (5, 5)]
    colours = dict(zip([f"R{i}" for i in range(len(lengths))], (BLUE, ORANGE, GREEN, PURPLE, RED), strict=True))
    fig, axes = plt.subplots(2, 1, figsize=(11, 5.6), sharex=True)
    t, batch = 0, [lengths[:4], lengths[4:]]  # static: batches of 4 in arrival order, each runs to its longest
    for b, group in enumerate(batch):
        longest = max(new for _, new in group)
        for r, (_, new) in enumerate(group):
            name = f"R{b * 4 + r}"
            axes[0].broken_barh([(t, 1)], (r, 0.8), fc=colours[name], hatch="//")
            axes[0].broken_barh([(t + 1, new - 1)], (r, 0.8), fc=colours[name]) if new > 1 else None
            if new < longest:
                axes[0].broken_barh([(t + new, longest - new)], (r, 0.8), fc="white", ec=GREY, hatch="..")
            axes[0].text(t + 0.1, r + 0.4, name, va="center", fontsize=8, color="white")
        t += longest
    axes[0].set_title(f"静态批：每批 4 个，跑到最长的那条才结束（点状 = 占着位置不干活），"
                      f"共 {t} 步；R4 等第一批全部结束",
                      fontsize=10)
    steps = _continuous_timeline(lengths, budget=8)
    for s, row in enumerate(steps):
        y = 0
        for name, n, prefill in row:
            axes[1].broken_barh([(s, 1)], (y, n * 0.35), fc=colours[name], ec="black", lw=0.4,
                                hatch="//" if prefill else None)
            axes[1].text(s + 0.5, y + n * 0.175, f"{name}\n{n}" if n > 1 else name, ha="center", va="center",
                         fontsize=6.5, color="white")
            y += n * 0.35
    axes[1].axhline(8 * 0.35, color="black", ls="--", lw=0.8)
    axes[1].text(len(steps) + 0.2, 8 * 0.35 + 0.05, "token 预算 8", va="bottom", fontsize=8)
    axes[1].set_title(f"连续批处理（项目的 Scheduler，预算 8、max_num_seqs 4）：每步重新排，结束的立刻离开；"
                      f"长提示被切成块（分块 prefill），与 decode 同一步；共 {len(steps)} 步", fontsize=10)
    axes[0].set(ylim=(0, 4), yticks=[], ylabel="批里的行")
    axes[1].set(yticks=[], ylabel="这一步的 token", xlabel="步")
    axes[0].legend(handles=[Rectangle((0, 0), 1, 1, fc=GREY, hatch="//", label="prefill"),
                            Rectangle((0, 0), 1, 1, fc=GREY, label="decode")], fontsize=8, loc="upper right")
    fig.tight_layout()
    save(fig, "06-batching-timeline.png")


def _packed_step():
    """A real engine step with two decode rows and one prefill chunk: a tiny LLMEngine (block_size 4, token
    budget 8) runs two steps, then its third step is scheduled and its inputs built as step() builds them
    (Scheduler.schedule, then ModelRunner.prepare). Returns the scheduled pairs, idx, positions, the metadata."""
    from mini_transformer import TransformerLM
    from mini_transformer.engine.config import EngineConfig
    from mini_transformer.engine.llm_engine import LLMEngine

    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=32, d_model=16, n_heads=2, d_ff=32, n_layer=1, max_seq_len=32))
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=12, max_num_batched_tokens=8,
                                           enable_prefix_caching=False, enforce_eager=True))
    params = SamplingParams(max_tokens=8)
    engine.add_request([1, 2, 3], params, "R0")
    engine.add_request([4, 5, 6, 7, 8], params, "R1")
    engine.step()  # R0 3 + R1 5 prompt tokens
    engine.add_request(list(range(10, 20)), params, "R2")
    engine.step()  # R0, R1 decode; R2's first chunk (6 of its 10 prompt tokens)
    plan = engine.scheduler.schedule()  # R0, R1 decode; R2's last 4 prompt tokens
    idx, positions, _, meta, _ = engine.runner.prepare(plan.scheduled, [])
    return plan.scheduled, idx[0].tolist(), positions[0].tolist(), meta


def packed_step(save) -> None:
    """The four tensors of one step, and the block-diagonal causal mask they imply (True = may attend)."""
    from matplotlib.colors import to_rgba

    scheduled, ids, positions, meta = _packed_step()
    qsl, slots = meta.query_start_loc.tolist(), meta.slot_mapping.tolist()
    tables, ctx, bs = meta.block_tables.tolist(), meta.context_lens.tolist(), meta.block_size
    names = [seq.request_id for seq, _ in scheduled]
    colours = (BLUE, ORANGE, GREEN)
    owner = [s for s in range(len(names)) for _ in range(qsl[s], qsl[s + 1])]  # each packed token's sequence
    fig, ax = plt.subplots(figsize=(11.5, 7.6))

    # the packed row and the two (N,) vectors under it
    x0, w = 2.2, 1.0
    for label, y, values in (("idx (1, N)", 9.0, ids), ("positions", 8.3, positions),
                             ("slot_mapping (N,)", 7.6, slots)):
        ax.text(x0 - 0.15, y + 0.3, label, ha="right", va="center", fontsize=9, family="monospace")
        for i, value in enumerate(values):
            packed = y == 9.0
            box(ax, x0 + i * w, y, w * 0.94, 0.6, str(value), fc=colours[owner[i]] if packed else "white",
                color="white" if packed else "black", fontsize=9)
    for s, start in enumerate(qsl):  # query_start_loc: where each sequence's tokens begin
        x = x0 + start * w - 0.03
        ax.plot([x, x], [7.5, 9.85], color="black", lw=1.4)
        ax.text(x, 9.9, str(start), ha="center", va="bottom", fontsize=9, fontweight="bold")
        if s < len(names):
            n = qsl[s + 1] - start
            kind = "\ndecode" if n == 1 else f"prefill 分块\n位置 {positions[start]}..{positions[start + n - 1]}"
            ax.text(x0 + (start + n / 2) * w - 0.03, 7.2, f"{names[s]}：{kind}", ha="center", va="top",
                    fontsize=8.5, color=colours[s])
    ax.text(x0 - 0.15, 10.05, f"query_start_loc (S+1,) = {qsl}", ha="right", va="bottom", fontsize=9,
            family="monospace")

    # block_tables (S, Bmax) and context_lens (S,)
    bx = x0 + len(ids) * w + 1.6
    ax.text(bx + len(tables[0]) * 0.8 / 2, 10.05, "block_tables (S, Bmax)", ha="center", va="bottom", fontsize=9,
            family="monospace")
    ax.text(bx + len(tables[0]) * 0.8 + 1.6, 10.05, "context_lens (S,)", ha="center", va="bottom", fontsize=9,
            family="monospace")
    for s, (row, n_keys) in enumerate(zip(tables, ctx, strict=True)):
        y = 9.3 - s * 0.75
        used = -(-n_keys // bs)  # blocks that hold this sequence's keys; the rest of the row is padding
        ax.text(bx - 0.15, y + 0.3, names[s], ha="right", va="center", fontsize=9, color=colours[s])
        for b, block in enumerate(row):
            pad = b >= used
            box(ax, bx + b * 0.8, y, 0.75, 0.6, str(block), fc="white" if pad else colours[s],
                color="black" if pad else "white", fontsize=9, alpha=0.5 if pad else 1)
            if pad:
                ax.add_patch(Rectangle((bx + b * 0.8, y), 0.75, 0.6, fc="none", ec=GREY, hatch="///", lw=0))
        box(ax, bx + len(row) * 0.8 + 1.3, y, 0.6, 0.6, str(n_keys), fontsize=9)
    ax.text(bx - 0.6, 7.05, "斜线格是填充（块 0，读不到：key 只读到 context_lens 为止）\n"
            f"slot = block_tables[s, p // {bs}] × {bs} + p % {bs}，例：{names[-1]} 的位置 {positions[-1]} → "
            f"{tables[-1][positions[-1] // bs]} × {bs} + {positions[-1] % bs} = {slots[-1]}",
            ha="left", va="top", fontsize=8.5)

    # the mask: packed queries x every sequence's keys, computed from the four tensors alone
    c, top = 0.5, 5.2
    key_x, kx = [], x0
    for s, n_keys in enumerate(ctx):
        key_x.append(kx)
        new = qsl[s + 1] - qsl[s]
        ax.text(kx + n_keys * c / 2, top + 0.95, f"{names[s]}：{n_keys} 个 key，本步写 {new} 个",
                ha="center", fontsize=8, color=colours[s])
        for p in range(n_keys):
            ax.text(kx + (p + 0.5) * c, top + 0.55, str(p), ha="center", fontsize=7)
            slot = tables[s][p // bs] * bs + p % bs
            ax.text(kx + (p + 0.5) * c, top + 0.3 - len(ids) * c - 0.3, str(slot), ha="center", fontsize=6.5,
                    color="#555555")
        kx += n_keys * c + 0.35
    ax.text(x0 - 0.15, top + 0.55, "key 位置 p", ha="right", fontsize=8)
    ax.text(x0 - 0.15, top + 0.3 - len(ids) * c - 0.3, "它的 slot", ha="right", fontsize=8, color="#555555")
    for i in range(len(ids)):
        s, y = owner[i], top + 0.3 - (i + 1) * c
        pos = ctx[s] - (qsl[s + 1] - i)  # this query's position: queries are the last keys of their sequence
        ax.text(x0 - 0.15, y + c / 2, f"query {i}（{names[s]}，p = {pos}）", ha="right", va="center", fontsize=8,
                color=colours[s])
        for t, n_keys in enumerate(ctx):
            for p in range(n_keys):
                allowed = t == s and p <= pos
                written = p >= ctx[t] - (qsl[t + 1] - qsl[t])
                fc = to_rgba(colours[t], 1.0 if written else 0.45) if allowed else "white"
                ax.add_patch(Rectangle((key_x[t] + p * c, y), c, c, fc=fc, ec="#dddddd", lw=0.5))
    ax.text(x0, top + 0.3 - len(ids) * c - 0.65,
            "掩码（queries × keys，着色 = True = 可以看）：key 与 query 同属一个序列、且位置 ≤ query 的位置。"
            "\n于是掩码是对角上的块：prefill 分块是一个矩形（池里已有的 key，浅色）接一个三角"
            "（本步写入的 key，深色），decode 行是整整一行",
            ha="left", va="top", fontsize=8.5)
    ax.set(xlim=(-1.4, max(kx, bx + len(tables[0]) * 0.8 + 2.3)), ylim=(top + 0.3 - len(ids) * c - 1.5, 10.6))
    ax.set_axis_off()
    ax.set_title(f"引擎的一步（block_size = {bs}，token 预算 8）：两个 decode 行和一个 prefill 分块打包成一行 "
                 f"N = {len(ids)}，\n注意力只需要这四个张量——都来自项目的 Scheduler 和 ModelRunner.prepare",
                 fontsize=10)
    save(fig, "06-packed-step.png")


# ------------------------------------------------------------------------------------------ 07
def request_path(save) -> None:
    fig, ax = plt.subplots(figsize=(11, 3.4))
    box(ax, 0, 1.2, 1.6, 0.9, "客户端\n（openai SDK、curl）", fc="#eeeeee")
    box(ax, 2.3, 1.2, 2.4, 0.9, "事件循环线程\nFastAPI 处理函数：检查、分词\n每个请求一个 asyncio.Queue", fc="#dde8f5")
    box(ax, 5.6, 1.2, 1.2, 0.9, "inbox\n（线程安全队列）", fc=YELLOW)
    box(ax, 7.7, 1.2, 2.6, 0.9, "引擎线程（只有它调用引擎）\nadd_request / abort / step()", fc="#e3f1e3")
    arrow(ax, (1.6, 1.8), (2.3, 1.8), "HTTP")
    arrow(ax, (4.7, 1.8), (5.6, 1.8), "submit")
    arrow(ax, (6.8, 1.8), (7.7, 1.8), "取出")
    arrow(ax, (7.7, 1.35), (4.7, 1.35), "每步一次 call_soon_threadsafe：这一步所有请求的输出", color=BLUE,
          offset=(0, -0.35))
    arrow(ax, (2.3, 1.35), (1.6, 1.35), "SSE", color=BLUE, offset=(0, -0.35))
    ax.set(xlim=(-0.2, 10.5), ylim=(0.4, 2.5))
    ax.set_axis_off()
    ax.set_title("一个请求的路径：所有客户端的请求在引擎线程的同一个 step() 里相遇"
                 "（服务器这一侧的连续批处理）", fontsize=10)
    save(fig, "07-request-path.png")


# ------------------------------------------------------------------------------------------ 08
def roofline_batch(save, bandwidth: float, peak: float, step_cost) -> None:
    ridge = peak / bandwidth
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    xs = [0.2, 40]
    ax.plot([xs[0], ridge], [xs[0] * bandwidth / 1e9, peak / 1e9], "k--",
            label=f"带宽屋顶：{bandwidth / 1e9:.1f} GB/s × 强度")
    ax.plot([ridge, xs[1]], [peak / 1e9, peak / 1e9], "k-", label=f"算力屋顶：{peak / 1e9:.0f} GFLOP/s（fp32 矩阵乘）")
    ax.axvline(ridge, color=GREY, lw=0.8)
    ax.text(ridge * 1.05, peak / 1e9 * 0.25, f"脊点 {ridge:.2f} FLOP/字节", fontsize=8.5)
    models = (("char（6 × 384，MHA）", dict(vocab_size=65, n_layer=6, n_heads=6, d_model=384, d_ff=1536), "o", BLUE),
              ("GPT-2 small", dict(vocab_size=50257, n_layer=12, n_heads=12, d_model=768, d_ff=3072), "s", ORANGE))
    for name, fields, marker, colour in models:
        cfg = TransformerConfig(max_seq_len=1024, **fields)
        points = []
        for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
            flops, nbytes = step_cost(cfg, batch, 256)
            points.append((flops / nbytes, min(peak, flops / nbytes * bandwidth) / 1e9, batch))
        ax.plot([p[0] for p in points], [p[1] for p in points], marker + "-", color=colour, ms=4, lw=0.8, label=name)
        for x, y, batch in points:
            if batch in (1, 8, 64, 512):
                ax.annotate(f"B={batch}", (x, y), (3, -11 if colour == BLUE else 5), textcoords="offset points",
                            fontsize=7, color=colour)
    ax.set(xscale="log", yscale="log", xlabel="算术强度：一步 decode 的 FLOPs ÷ 读的字节", ylabel="可达 GFLOP/s")
    ax.set_title("decode 的屋顶线（fp32，每个序列已缓存 256 个 token）："
                 "batch 变大，权重被摊薄，强度越过脊点就算力受限；"
                 "\nMHA 的小模型强度停在 5 左右——每个序列自己的 K、V 摊不薄", fontsize=9.5)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    save(fig, "08-roofline-batch.png")


def speculative_step(save) -> None:
    fig, ax = plt.subplots(figsize=(11, 3.3))
    drafts = [("d1", "接受", GREEN), ("d2", "接受", GREEN), ("d3", "拒绝", RED), ("d4", "丢弃", GREY)]
    box(ax, 0, 1.6, 1.2, 0.6, "上下文 …", fc="#eeeeee")
    for i, (name, verdict, colour) in enumerate(drafts):
        x = 1.5 + i * 1.5
        box(ax, x, 1.6, 1.2, 0.6, f"草稿 {name}\n~ q", fc=YELLOW)
        box(ax, x, 0.6, 1.2, 0.6, verdict, fc=colour, color="white" if colour != GREY else "black")
        arrow(ax, (x + 0.6, 1.6), (x + 0.6, 1.2))
    box(ax, 1.5 + 4 * 1.5, 1.6, 2.2, 0.6, "目标一次前向：\nk + 1 个位置的 p", fc="#dde8f5")
    box(ax, 1.5 + 4 * 1.5, 0.6, 2.2, 0.6, "d3 处从 max(p − q, 0)\n归一化后采一个 token", fc=BLUE, color="white")
    ax.text(0, 0.15, "规则：以 min(1, p(d)/q(d)) 接受；第一次拒绝时从残差分布采样、本轮结束；"
            "k 个全部接受时再从 p 采一个奖励 token。"
            "这一轮产出 d1、d2 和一个新 token：3 个 token，只花了目标的一次前向。", fontsize=8.5)
    ax.set(xlim=(-0.2, 10), ylim=(0, 2.4))
    ax.set_axis_off()
    ax.set_title("投机解码的一轮（k = 4）：输出的分布与目标逐个 token 相同", fontsize=10)
    save(fig, "08-speculative-step.png")


# ------------------------------------------------------------------------------------------ 09
def moe_dispatch(save) -> None:
    experts = [[2, 0], [1, 2], [0, 3], [2, 1]]  # token n -> its two experts
    colours = (BLUE, ORANGE, GREEN, PURPLE)
    fig, ax = plt.subplots(figsize=(10.5, 3.8))
    flat = [(n, e) for n, pair in enumerate(experts) for e in pair]
    order = sorted(range(len(flat)), key=lambda i: flat[i][1])
    for i, (n, e) in enumerate(flat):
        box(ax, i * 0.9, 2.2, 0.8, 0.55, f"t{n}→E{e}", fc=colours[e], color="white", fontsize=8)
    for j, i in enumerate(order):
        n, e = flat[i]
        box(ax, j * 0.9, 0.6, 0.8, 0.55, f"t{n}", fc=colours[e], color="white", fontsize=8)
        arrow(ax, (i * 0.9 + 0.4, 2.2), (j * 0.9 + 0.4, 1.15), color=GREY)
    ax.text(-0.1, 3.0, "(token, 选择) 槽位：每个 token 选 k = 2 个专家（N·k = 8 行）", fontsize=9)
    ax.text(-0.1, 0.25, "argsort 按专家排好：每个专家一段连续的行，一次分组矩阵乘算完；"
            "结果乘路由权重后 index_add 回各自的 token",
            fontsize=9)
    ax.set(xlim=(-0.2, 7.5), ylim=(0, 3.3))
    ax.set_axis_off()
    ax.set_title("MoE 的 dropless dispatch：没有按 token 的循环，也不丢 token", fontsize=10)
    save(fig, "09-moe-dispatch.png")



# ------------------------------------------------------------------------------------------ 12
def structured_step(save) -> None:
    """One engine step with a constrained row: the real mask of choice ("yes", "no", "yesterday") after
    "yes", from the project's StructuredOutputManager (xgrammar) over a toy vocabulary."""
    import xgrammar as xgr

    from mini_transformer.engine.structured import StructuredOutputManager
    from mini_transformer.inference.structured import StructuredOutput

    vocab = ["<eos>", "y", "e", "s", "n", "o", "ye", "yes", "no!", "ter", "t", "day", "ab", "x"]
    matcher = StructuredOutputManager(vocab, len(vocab), 0).matcher(StructuredOutput(choice=("yes", "no", "yesterday")))
    for token in ("ye", "s"):
        matcher.accept_token(vocab.index(token))
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    matcher.fill_next_token_bitmask(bitmask, 0)
    word = bitmask[0, 0].item()
    allowed = [bool((word >> t) & 1) for t in range(len(vocab))]

    fig, ax = plt.subplots(figsize=(11, 4.6))
    box(ax, 0, 3.6, 5.6, 0.55, "前向：模型算出这一步 M 行的 logits（GPU 上异步；CPU 上在主线程）", fc="#dde8f5")
    box(ax, 0, 2.85, 2.6, 0.55, "工作线程：xgrammar 填受约束行的\nbitmask（只依赖已接受的 token）",
        fc=YELLOW, fontsize=8)
    box(ax, 5.9, 3.2, 1.9, 0.95, "采样器：惩罚项\n→ 掩码（-inf）\n→ argmax / 过滤、抽样", fc=GREEN, color="white",
        fontsize=8.5)
    box(ax, 8.1, 3.2, 1.9, 0.95, "读回 token\n→ matcher.accept_token\n→ 语法结束就停", fc=BLUE, color="white",
        fontsize=8.5)
    arrow(ax, (5.6, 3.87), (5.9, 3.7))
    arrow(ax, (2.6, 3.12), (5.9, 3.4))
    arrow(ax, (7.8, 3.67), (8.1, 3.67))
    ax.text(0, 2.45, "同一时间轴：填掩码与前向重叠；采样器只等没被前向盖住的那一部分", fontsize=8.5)
    ax.text(0, 1.75, "choice = (\"yes\", \"no\", \"yesterday\")，已生成 \"yes\"（token \"ye\" + \"s\"）："
            f"下一个 token 的掩码（真实的 bitmask 字 = {word}）", fontsize=9)
    for t, (token, ok) in enumerate(zip(vocab, allowed, strict=True)):
        box(ax, t * 0.72, 0.75, 0.66, 0.6, token, fc=GREEN if ok else GREY, fontsize=8,
            color="white" if ok else "black")
        ax.text(t * 0.72 + 0.33, 0.5, f"bit {t}", ha="center", fontsize=6.5)
    ax.text(0, 0.05, "绿色 = 允许：\"t\"、\"ter\" 通向 yesterday；<eos> 允许，因为 \"yes\" 已是完整选项。"
            "\"day\" 也只含选项里的字母，但 \"yesday\" 不是任何选项的前缀，被禁", fontsize=8.5)
    ax.set(xlim=(-0.2, 10.2), ylim=(0, 4.3))
    ax.set_axis_off()
    ax.set_title("结构化输出的一步：语法 → 每步一个 token 掩码，在采样前施加", fontsize=10)
    save(fig, "12-structured-step.png")

# ------------------------------------------------------------------------------------------ 10
def tensor_parallel(save) -> None:
    fig, ax = plt.subplots(figsize=(11, 3.8))
    for row, (name, first, middle, last) in enumerate((
            ("attention", "W_qkv 按列切\nrank r：第 r 组头的 q、k、v", "每个 rank 用本地的头\n做完整的 attention",
             "W_o 按行切\n得到部分和"),
            ("MLP", "fc1（w_gate、w_up）按列切\nrank r：第 r 段隐藏单元", "GELU / SwiGLU\n逐元素，只在本段内",
             "fc2 / w_down 按行切\n得到部分和"))):
        y = 2.1 - row * 1.7
        box(ax, 0, y, 1.4, 1.0, "x\n(B, T, C)\n每个 rank 一份", fc="#eeeeee", fontsize=8)
        box(ax, 2.0, y, 2.6, 1.0, first, fc="#dde8f5", fontsize=8.5)
        box(ax, 5.1, y, 2.2, 1.0, middle, fc="#e3f1e3", fontsize=8.5)
        box(ax, 7.8, y, 1.8, 1.0, last, fc="#dde8f5", fontsize=8.5)
        box(ax, 10.1, y + 0.2, 1.4, 0.6, "all_reduce", fc=RED, color="white")
        for a, b in ((1.4, 2.0), (4.6, 5.1), (7.3, 7.8), (9.6, 10.1)):
            arrow(ax, (a, y + 0.5), (b, y + 0.5))
        ax.text(-0.2, y + 0.5, name, ha="right", va="center", fontsize=10)
    ax.text(5.5, -0.05, "列切紧跟行切：列切的输出正好是行切要的“分好段的输入”，中间不通信；每层只有这两次 all_reduce",
            ha="center", fontsize=9)
    ax.set(xlim=(-1.4, 11.7), ylim=(-0.3, 3.3))
    ax.set_axis_off()
    ax.set_title("张量并行（Megatron 切法）：一个 block 里两次 all_reduce", fontsize=10)
    save(fig, "10-tensor-parallel.png")


def pipeline_bubble(save, p: int = 4, m: int = 4) -> None:
    """GPipe's schedule from its definition (forward of micro-batch j on stage s at time s + j; backward
    mirrored), not a measured timeline."""
    fig, ax = plt.subplots(figsize=(11, 3.0))
    total = 2 * (m + p - 1)
    for s in range(p):
        y = p - 1 - s
        for j in range(m):
            box(ax, s + j, y, 0.95, 0.85, f"F{j}", fc=BLUE, color="white", fontsize=8)
            box(ax, m + p - 1 + (p - 1 - s) + j, y, 0.95, 0.85, f"B{j}", fc=ORANGE, color="white", fontsize=8)
        ax.text(-0.2, y + 0.42, f"stage {s}", ha="right", va="center", fontsize=9)
    ax.set(xlim=(-1.3, total + 0.2), ylim=(-0.2, p))
    ax.set_axis_off()
    bubble = (p - 1) / (m + p - 1)
    ax.set_title(f"GPipe 调度（p = {p} 个 stage，m = {m} 个 micro-batch）："
                 f"白色是气泡，占 (p − 1)/(m + p − 1) = {bubble:.0%}"
                 "（按公式画，不是实测的时间线）", fontsize=10)
    save(fig, "10-pipeline-bubble.png")


def pd_flow(save) -> None:
    fig, ax = plt.subplots(figsize=(11, 3.0))
    box(ax, 0, 1.0, 1.4, 0.9, "请求\n（提示 T 个 token）", fc="#eeeeee")
    box(ax, 2.2, 1.0, 2.6, 0.9, "rank 0：prefill 引擎\nprefill_for_handoff\n算力受限", fc="#dde8f5")
    box(ax, 6.3, 1.0, 2.6, 0.9, "rank 1：decode 引擎\nadopt_prefilled\n带宽受限，凑大 batch", fc="#e3f1e3")
    box(ax, 9.6, 1.0, 1.2, 0.9, "输出 token", fc="#eeeeee")
    arrow(ax, (1.4, 1.45), (2.2, 1.45))
    arrow(ax, (4.8, 1.45), (6.3, 1.45), "send：头、生成器状态、\nK/V (2, L, T, Hkv, D)", offset=(0, 0.2))
    arrow(ax, (8.9, 1.45), (9.6, 1.45))
    ax.text(5.5, 0.45, "传的是块的内容，不是块号：decode 一侧在自己的池里分配块，写进对应的槽，从下一步起只做 decode",
            ha="center", fontsize=8.5)
    ax.set(xlim=(-0.2, 11), ylim=(0.2, 2.4))
    ax.set_axis_off()
    ax.set_title("PD 分离：prefill 与 decode 在不同的进程（机器）上，中间只传这个请求的 KV cache", fontsize=10)
    save(fig, "10-pd-flow.png")


def draw_all(save, roofline_numbers, step_cost) -> None:
    """roofline_numbers: (read bandwidth bytes/s, fp32 matmul FLOP/s) as docs/08a reports them."""
    block_pool(save)
    prefix_hash_chain(save)
    batching_timeline(save)
    packed_step(save)
    request_path(save)
    roofline_batch(save, *roofline_numbers, step_cost)
    speculative_step(save)
    moe_dispatch(save)
    tensor_parallel(save)
    pipeline_bubble(save)
    pd_flow(save)
    structured_step(save)
