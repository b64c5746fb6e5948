"""The concept figure of docs/13 (Chinese labels); docs/figures.py calls cluster().

Left: data-parallel replicas behind vllm-router, which picks a replica from what it knows about their KV
caches (its own radix tree of the prompts it sent, or the replicas' KV events). Right: prefill/decode
disaggregation across servers, the prefill server's full blocks reaching the decode server through the
KV store. A drawing of the design, not of a measured run.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from figures_systems import BLUE, GREEN, ORANGE, RED, YELLOW, arrow, box

CLIENT, ROUTER, SERVER, STORE = "#eeeeee", YELLOW, "#e3f1e3", "#fdecea"


def _replicas(ax) -> None:
    box(ax, 0.0, 4.2, 2.0, 0.7, "客户端\n（OpenAI API）", fc=CLIENT)
    box(ax, 3.0, 3.9, 4.4, 1.3, "vllm-router（一个地址）\ncache_aware：发出过的提示建成基数树\n"
        "kv_aware：按副本报来的 KV 事件建块索引", fc=ROUTER, fontsize=8.5)
    arrow(ax, (2.0, 4.55), (3.0, 4.55))
    for x, name, held in ((1.2, "副本 A", "持有系统提示 1 的块"), (5.2, "副本 B", "持有系统提示 2 的块")):
        box(ax, x, 0.6, 3.0, 1.6, f"{name}：mini-transformer serve\n块池 + 前缀缓存\n{held}", fc=SERVER,
            fontsize=8.5)
        arrow(ax, (x + 1.0, 3.9), (x + 1.0, 2.2), "请求", color=BLUE, offset=(-0.35, 0))
        arrow(ax, (x + 2.0, 2.2), (x + 2.0, 3.9), "KV 事件", color=ORANGE, offset=(0.45, 0))
    ax.text(4.2, 0.15, "同一个系统提示的请求去同一个副本：它的前缀块已在那里，只算尾巴", ha="center", fontsize=8.5)
    ax.set(xlim=(-0.2, 8.6), ylim=(0, 5.5))
    ax.set_axis_off()
    ax.set_title("数据并行：路由器按谁持有前缀来选副本", fontsize=10)


def _prefill_decode(ax) -> None:
    box(ax, 0.0, 4.2, 1.8, 0.7, "客户端", fc=CLIENT)
    box(ax, 2.6, 4.1, 3.6, 0.9, "vllm-router --vllm-pd-disaggregation\n同一个请求 id 先后发给两边", fc=ROUTER,
        fontsize=8.5)
    arrow(ax, (1.8, 4.55), (2.6, 4.55))
    box(ax, 0.0, 1.6, 2.6, 1.3, "prefill 服务器\nserve --kv-role producer\n算整段提示，存满块", fc="#dde8f5",
        fontsize=8.5)
    box(ax, 3.3, 1.6, 2.0, 1.3, "KV 存储（Redis）\n键 = 模型指纹 + 链式哈希\n值 = 一块的 K/V", fc=STORE, fontsize=8)
    box(ax, 6.0, 1.6, 2.6, 1.3, "decode 服务器\nserve --kv-role consumer\n载入前缀块，只算余下的", fc=SERVER,
        fontsize=8.5)
    arrow(ax, (3.2, 4.1), (1.6, 2.9), "① max_tokens = 1", color=BLUE, offset=(-0.55, 0.1))
    arrow(ax, (5.6, 4.1), (7.0, 2.9), "② 原请求", color=BLUE, offset=(0.5, 0.1))
    arrow(ax, (2.6, 2.25), (3.3, 2.25), color=RED)
    arrow(ax, (5.3, 2.25), (6.0, 2.25), color=RED)
    ax.text(4.3, 1.2, "每个提示 token 搬 2·L·Hkv·D·b 字节", ha="center", fontsize=8.5, color=RED)
    arrow(ax, (8.3, 2.9), (6.2, 4.45), "输出 token 经路由器\n回到客户端", color=GREEN, offset=(1.05, 0.1))
    ax.text(4.3, 0.15, "prefill 先存完再回答；decode 等块只等有限的时间，等不到就自己重算", ha="center",
            fontsize=8.5)
    ax.set(xlim=(-0.2, 8.8), ylim=(0, 5.5))
    ax.set_axis_off()
    ax.set_title("PD 分离：prefill 与 decode 是两个服务器，K/V 经 KV 存储过去", fontsize=10)


def cluster(save) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.6))
    _replicas(left)
    _prefill_decode(right)
    fig.tight_layout()
    save(fig, "13-cluster.png")
