"""The numbers of docs/worked-problems.md: Llama-3-8B and Llama-3-70B in bf16 on one H100 and on one 8×H100
node, worked out on paper. Every figure on that page is printed by this script, and
tests/test_worked_problems.py checks that the page still says what the script prints:

    uv run python docs/worked_problems.py

Each function is one formula of the page, written for reading. Units are in the names: *_bytes are bytes,
*_s seconds, *_flops floating-point operations (a multiply-add is 2). GB = 1e9 bytes; GiB = 2**30 bytes.
The estimates are bounds (roofline style): they leave out activations, kernels' efficiency, latency and
overlap, the way kipply's "Transformer Inference Arithmetic" and the JAX scaling book do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# ------------------------------------------------------------------------------- hardware
# NVIDIA H100 SXM5 80GB, datasheet (nvidia.com/en-us/data-center/h100): bf16 Tensor Core 1,979 TFLOP/s
# "with sparsity", so 989 TFLOP/s dense; HBM3 3.35 TB/s; 80 GB; NVLink 900 GB/s (both directions together).
H100_BF16_FLOPS = 989e12        # FLOP/s, dense bf16
H100_HBM_BYTES_PER_S = 3.35e12  # B/s
H100_HBM_BYTES = 80e9           # B
NVLINK_BYTES_PER_S = 900e9      # B/s per GPU, sending and receiving together
NVLINK_ONE_WAY_BYTES_PER_S = NVLINK_BYTES_PER_S / 2  # what one GPU can send while it receives as much
# One 400 Gb/s NIC (ConnectX-7 / InfiniBand NDR) between the prefill and the decode machine: bits -> bytes.
NIC_BYTES_PER_S = 400e9 / 8
BF16_BYTES = 2
NODE_GPUS = 8


@dataclass(frozen=True)
class Model:
    """The shape of a Llama-style decoder (SwiGLU FFN, GQA, untied embedding and head)."""

    name: str
    n_layer: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_ff: int
    vocab: int


# meta-llama/Meta-Llama-3-8B, config.json on Hugging Face: num_hidden_layers 32, hidden_size 4096,
# num_attention_heads 32, num_key_value_heads 8 (head dim 4096/32 = 128), intermediate_size 14336,
# vocab_size 128256, tie_word_embeddings false.
LLAMA3_8B = Model("Llama-3-8B", n_layer=32, d_model=4096, n_heads=32, n_kv_heads=8, d_head=128, d_ff=14336,
                  vocab=128256)
# meta-llama/Meta-Llama-3-70B, config.json: 80 layers, hidden_size 8192, 64 heads, 8 KV heads (head dim 128),
# intermediate_size 28672, vocab_size 128256.
LLAMA3_70B = Model("Llama-3-70B", n_layer=80, d_model=8192, n_heads=64, n_kv_heads=8, d_head=128, d_ff=28672,
                   vocab=128256)
# mistralai/Mixtral-8x7B-v0.1, config.json: hidden_size 4096, num_local_experts 8, num_experts_per_tok 2,
# num_hidden_layers 32.
MIXTRAL_D_MODEL, MIXTRAL_EXPERTS, MIXTRAL_TOP_K, MIXTRAL_LAYERS = 4096, 8, 2, 32

CONTEXT = 8192  # tokens: "8k context"


# ------------------------------------------------------------------------------- the formulas
def layer_params(m: Model) -> int:
    """One block: W_q and W_o (d·H·D each), W_k and W_v (d·Hkv·D each), three FFN matrices, two RMSNorms."""
    attention = 2 * m.d_model * m.n_heads * m.d_head + 2 * m.d_model * m.n_kv_heads * m.d_head
    return attention + 3 * m.d_model * m.d_ff + 2 * m.d_model


def params(m: Model) -> int:
    """Embedding + blocks + final norm + LM head (untied)."""
    return m.vocab * m.d_model + m.n_layer * layer_params(m) + m.d_model + m.d_model * m.vocab


def weight_bytes(m: Model) -> int:
    return params(m) * BF16_BYTES


def kv_bytes_per_token(m: Model) -> int:
    """K and V, every layer, every KV head: 2 · n_layer · Hkv · D · 2 bytes."""
    return 2 * m.n_layer * m.n_kv_heads * m.d_head * BF16_BYTES


def kv_bytes_per_sequence(m: Model, tokens: int = CONTEXT) -> int:
    return kv_bytes_per_token(m) * tokens


def fits(m: Model, gpus: int) -> bool:
    return weight_bytes(m) < gpus * H100_HBM_BYTES


def max_batch(m: Model, gpus: int, tokens: int = CONTEXT) -> int:
    """Sequences of `tokens` whose KV fits in the HBM the weights leave (activations ignored): an upper bound."""
    return max(0, math.floor((gpus * H100_HBM_BYTES - weight_bytes(m)) / kv_bytes_per_sequence(m, tokens)))


def decode_ceiling_tokens_per_s(m: Model, gpus: int) -> float:
    """Batch 1: each step reads every weight once; the GPUs read their shards side by side (TP)."""
    return gpus * H100_HBM_BYTES_PER_S / weight_bytes(m)


def ridge_batch() -> float:
    """A decode step at batch B does 2·P·B FLOPs on 2·P bytes of weights: B FLOPs per byte. It turns
    compute-bound where B reaches the GPU's FLOPs per byte of HBM (the same for any model, any TP degree)."""
    return H100_BF16_FLOPS / H100_HBM_BYTES_PER_S


def prefill_flops(m: Model, tokens: int = CONTEXT) -> int:
    """2 FLOPs per weight per token in the blocks, causal attention (QK^T and PV, half the square:
    2 · T² · H·D per layer), and the LM head for the last token only."""
    matmuls = 2 * m.n_layer * (layer_params(m) - 2 * m.d_model) * tokens
    attention = 2 * m.n_layer * tokens * tokens * m.n_heads * m.d_head
    return matmuls + attention + 2 * m.d_model * m.vocab


def prefill_s(m: Model, gpus: int, tokens: int = CONTEXT) -> float:
    """Compute-bound: FLOPs over the GPUs' peak (a lower bound: real matmuls run below peak)."""
    return prefill_flops(m, tokens) / (gpus * H100_BF16_FLOPS)


def tp_allreduce_bytes_per_token(m: Model) -> int:
    """Per layer two all-reduces (after attention, after the FFN) of one d_model activation in bf16."""
    return m.n_layer * 2 * m.d_model * BF16_BYTES


def ring_send_bytes(data_bytes: float, p: int = NODE_GPUS) -> float:
    """A ring all-reduce (reduce-scatter then all-gather) sends 2(p−1)/p of the data from each GPU."""
    return 2 * (p - 1) / p * data_bytes


def pd_transfer_s(m: Model, tokens: int = CONTEXT) -> float:
    """Prefill and decode on different machines: the prompt's KV crosses one 400 Gb/s NIC."""
    return kv_bytes_per_sequence(m, tokens) / NIC_BYTES_PER_S


def ep_bytes_per_token_layer(d_model: int = MIXTRAL_D_MODEL, top_k: int = MIXTRAL_TOP_K) -> int:
    """Dispatch sends the token's d_model activation to each of its top_k experts; combine brings top_k
    outputs back: 2 · top_k · d_model · 2 bytes."""
    return 2 * top_k * d_model * BF16_BYTES


def ep_cross_gpu_fraction(gpus: int = NODE_GPUS) -> float:
    """With routing spread evenly, an expert sits on another GPU (p−1)/p of the time."""
    return (gpus - 1) / gpus


# ------------------------------------------------------------------------------- the page's tables
KIB, MIB, GIB = 2**10, 2**20, 2**30
SETUPS = [(LLAMA3_8B, 1), (LLAMA3_8B, NODE_GPUS), (LLAMA3_70B, 1), (LLAMA3_70B, NODE_GPUS)]


def _setup_name(m: Model, gpus: int) -> str:
    return f"{m.name}，{'1×H100' if gpus == 1 else f'8×H100（TP={gpus}）'}"


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def model_table() -> str:
    rows = [_row(["模型", "参数", "bf16 权重", "KV / token", "KV / 8k 上下文"]), _row(["---"] * 5)]
    for m in (LLAMA3_8B, LLAMA3_70B):
        rows.append(_row([m.name, f"{params(m) / 1e9:.2f} B", f"{weight_bytes(m) / 1e9:.1f} GB",
                          f"{kv_bytes_per_token(m):,} B（{kv_bytes_per_token(m) // KIB} KiB）",
                          f"{kv_bytes_per_sequence(m) / GIB:.2f} GiB"]))
    return "\n".join(rows)


def serving_table() -> str:
    rows = [_row(["部署", "权重 / GPU", "8k 上下文最大 batch", "batch 1 decode 上限", "8k prefill（算力上限）"]),
            _row(["---"] * 5)]
    for m, gpus in SETUPS:
        if not fits(m, gpus):
            rows.append(_row([_setup_name(m, gpus), f"{weight_bytes(m) / gpus / 1e9:.1f} GB > 80 GB", "放不下",
                              "—", "—"]))
            continue
        rows.append(_row([_setup_name(m, gpus), f"{weight_bytes(m) / gpus / 1e9:.1f} GB", f"{max_batch(m, gpus)}",
                          f"{decode_ceiling_tokens_per_s(m, gpus):.0f} token/s",
                          f"{prefill_s(m, gpus) * 1e3:.0f} ms"]))
    return "\n".join(rows)


def communication_table() -> str:
    rows = [_row(["通信", "Llama-3-8B", "Llama-3-70B"]), _row(["---"] * 3)]
    ar = [tp_allreduce_bytes_per_token(m) for m in (LLAMA3_8B, LLAMA3_70B)]
    rows.append(_row(["TP=8 all-reduce 的数据 / token", *(f"{b // KIB:,} KiB" for b in ar)]))
    rows.append(_row(["ring 中每张 GPU 发出 / token", *(f"{ring_send_bytes(b) / KIB:,.0f} KiB" for b in ar)]))
    microseconds = [ring_send_bytes(b) / NVLINK_ONE_WAY_BYTES_PER_S * 1e6 for b in ar]
    rows.append(_row(["同上在 NVLink 单向 450 GB/s 上", *(f"{us:.1f} µs" for us in microseconds)]))
    rows.append(_row(["PD：8k 提示的 KV 过 400 Gb/s", *(f"{pd_transfer_s(m) * 1e3:.1f} ms"
                                                        for m in (LLAMA3_8B, LLAMA3_70B))]))
    return "\n".join(rows)


def ep_table() -> str:
    per = ep_bytes_per_token_layer()
    cross = per * ep_cross_gpu_fraction()
    rows = [_row(["Mixtral 形状（d_model 4096，8 专家，top-2，EP=8）", "字节"]), _row(["---"] * 2),
            _row(["每 token 每层（dispatch + combine）", f"{per:,} B（{per // KIB} KiB）"]),
            _row(["其中离开本 GPU 的（7/8）", f"{cross:,.0f} B（{cross / KIB:.0f} KiB）"]),
            _row([f"每 token、{MIXTRAL_LAYERS} 层", f"{per * MIXTRAL_LAYERS / MIB:.0f} MiB"]),
            _row([f"一次 {CONTEXT} token 的 prefill、每层", f"{per * CONTEXT / MIB:.0f} MiB"])]
    return "\n".join(rows)


def ridge_line() -> str:
    return (f"屋顶线的拐点：{H100_BF16_FLOPS / 1e12:.0f} TFLOP/s ÷ {H100_HBM_BYTES_PER_S / 1e12:.2f} TB/s "
            f"≈ {ridge_batch():.0f} FLOP/字节，即 batch ≈ {ridge_batch():.0f} 时 decode 由访存受限变成算力受限。")


def prose_numbers() -> dict[str, str]:
    """The numbers the page's prose quotes beside its tables, formatted as the page writes them."""
    w8, w70 = weight_bytes(LLAMA3_8B), weight_bytes(LLAMA3_70B)
    prefill = prefill_flops(LLAMA3_8B)
    attention = 2 * LLAMA3_8B.n_layer * CONTEXT**2 * LLAMA3_8B.d_model
    no_gqa = Model("70B without GQA", 80, 8192, 64, 64, 128, 28672, 128256)
    return {
        "NIC GB/s": f"{NIC_BYTES_PER_S / 1e9:.0f}",
        "8B weights GB": f"{w8 / 1e9:.2f}",
        "HBM left for KV, GB": f"{H100_HBM_BYTES / 1e9 - round(w8 / 1e9, 2):.2f}",
        "8k sequence KV, GB": f"{kv_bytes_per_sequence(LLAMA3_8B) / 1e9:.2f}",
        "70B weights GB, rounded": f"{w70 / 1e9:.0f}",
        "70B KV / 8B KV": f"{kv_bytes_per_token(LLAMA3_70B) / kv_bytes_per_token(LLAMA3_8B):.1f}",
        "70B KV per token without GQA, MiB": f"{kv_bytes_per_token(no_gqa) / MIB:.1f}",
        "70B KV per 8k, GiB": f"{kv_bytes_per_sequence(LLAMA3_70B) / GIB:.1f}",
        "8B batch-1 ms per token": f"{1e3 / decode_ceiling_tokens_per_s(LLAMA3_8B, 1):.1f}",
        "8B prefill FLOP / 1e14": f"{prefill / 1e14:.2f}",
        "attention share of 8B prefill, %": f"{100 * attention / prefill:.0f}",
        "ring factor for p = 8": f"{ring_send_bytes(1.0):.2f}",
        "all-reduces per token, 8B": f"{2 * LLAMA3_8B.n_layer}",
        "all-reduces per token, 70B": f"{2 * LLAMA3_70B.n_layer}",
        "ring steps for p = 8": f"{2 * (NODE_GPUS - 1)}",
        "70B PD transfer ms, rounded": f"{pd_transfer_s(LLAMA3_70B) * 1e3:.0f}",
    }


TABLES = {"models": model_table, "serving": serving_table, "ridge": ridge_line, "communication": communication_table,
          "ep": ep_table}


def render(name: str) -> str:
    """One generated block of the page, as it sits between its markers."""
    return TABLES[name]()


if __name__ == "__main__":
    for name in TABLES:
        print(f"<!-- worked_problems: {name} -->\n{render(name)}\n<!-- /worked_problems -->\n")
