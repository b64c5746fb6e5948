"""`mini-transformer info`: where the parameters live, and what weights and the KV cache cost in memory."""

from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..model.transformer import TransformerLM

MiB = 2**20


def count_parameters(cfg: TransformerConfig) -> dict[str, int]:
    """Parameter count per component, built on the meta device (no memory, no init cost)."""
    with torch.device("meta"):
        model = TransformerLM(cfg)
    groups = {"token embedding": 0, "position embedding": 0, "attention": 0, "ffn": 0, "norms": 0, "lm head": 0}
    if cfg.ffn == "moe":  # the MoE FFN in its parts: only k of the n_experts run for a token
        del groups["ffn"]
        groups = {**groups, "ffn router": 0, "ffn experts": 0, "ffn shared expert": 0}
    for name, param in model.named_parameters():  # a tied head is listed once, as tok_emb.weight
        if name.startswith("tok_emb"):
            groups["token embedding"] += param.numel()
        elif name.startswith("pos_emb"):
            groups["position embedding"] += param.numel()
        elif ".attn." in name:
            groups["attention"] += param.numel()
        elif ".ffn." in name:
            kinds = ("router", "experts", "shared expert")
            part = "ffn" if cfg.ffn != "moe" else next(f"ffn {k}" for k in kinds if f".{k.replace(' ', '_')}" in name)
            groups[part] += param.numel()
        elif "norm" in name:
            groups["norms"] += param.numel()
        elif name.startswith("lm_head"):
            groups["lm head"] += param.numel()
        else:
            raise RuntimeError(f"parameter {name} belongs to no component")
    return groups


def kv_bytes_per_token(cfg: TransformerConfig, n_kv_heads: int | None = None, bytes_per_value: int = 2) -> int:
    """Keys and values of one token in every layer: 2 * n_layer * n_kv_heads * d_head * bytes."""
    n_kv_heads = cfg.n_kv_heads if n_kv_heads is None else n_kv_heads
    return 2 * cfg.n_layer * n_kv_heads * cfg.d_head * bytes_per_value


def active_parameters(cfg: TransformerConfig, groups: dict[str, int]) -> int:
    """Parameters one token is computed with: everything but the experts it was not routed to."""
    total = sum(groups.values())
    if cfg.ffn != "moe":
        return total
    experts = groups["ffn experts"]
    return total - experts + experts * cfg.n_experts_per_tok // cfg.n_experts


def describe_moe(cfg: TransformerConfig, groups: dict[str, int]) -> list[str]:
    total, active = sum(groups.values()), active_parameters(cfg, groups)
    experts = groups["ffn experts"]
    per_expert = experts // (cfg.n_layer * cfg.n_experts)
    shared = f", shared expert d_ff={cfg.moe_shared_expert_size}" if cfg.moe_shared_expert_size else ""
    gate = " (sigmoid-gated)" if cfg.moe_shared_expert_gate else ""
    renorm = "renormalised to sum 1" if cfg.moe_norm_topk_prob else "raw softmax probabilities"
    return [
        "",
        f"MoE: {cfg.n_experts} experts per layer, top-{cfg.n_experts_per_tok} ({renorm}), "
        f"each a {cfg.moe_expert_ffn} FFN of d_ff={cfg.d_ff}{shared}{gate}; aux loss coef {cfg.moe_aux_loss_coef}",
        f"{'total parameters':<30}{total:>16,}",
        f"{'active per token':<30}{active:>16,}  ({active / total:.1%} of the total: "
        f"{cfg.n_experts_per_tok} of {cfg.n_experts} experts run)",
        f"{'one expert':<30}{per_expert:>16,}",
        f"expert memory: all experts fp32 {experts * 4 / MiB:,.1f} MiB, bf16 {experts * 2 / MiB:,.1f} MiB "
        f"({experts / total:.1%} of the weights); one expert bf16 {per_expert * 2 / MiB:,.2f} MiB",
        "  every expert must sit in memory although a token uses only k of them: MoE buys compute, not memory",
    ]


def describe(cfg: TransformerConfig) -> str:
    groups = count_parameters(cfg)
    total = sum(groups.values())
    head = cfg.vocab_size * cfg.d_model
    tied_total, untied_total = (total, total + head) if cfg.tie_weights else (total - head, total)
    lines = [
        f"d_model={cfg.d_model}  n_heads={cfg.n_heads}  n_kv_heads={cfg.n_kv_heads}  d_head={cfg.d_head}  "
        f"d_ff={cfg.d_ff}  n_layer={cfg.n_layer}  vocab_size={cfg.vocab_size}  max_seq_len={cfg.max_seq_len}",
        f"pos_emb={cfg.pos_emb}  norm={cfg.norm} ({cfg.norm_position})  ffn={cfg.ffn}  bias={cfg.bias}  "
        f"tie_weights={cfg.tie_weights}  attn_backend={cfg.attn_backend}",
        "",
        f"{'component':<22}{'parameters':>16}{'share':>9}",
    ]
    for name, count in groups.items():
        note = "  (tied: shares the token embedding)" if name == "lm head" and cfg.tie_weights else ""
        lines.append(f"{name:<22}{count:>16,}{count / total:>9.1%}{note}")
    lines += [
        f"{'total':<22}{total:>16,}",
        f"{'  if tied':<22}{tied_total:>16,}",
        f"{'  if untied':<22}{untied_total:>16,}",
        "",
        f"weights: fp32 {total * 4 / MiB:,.1f} MiB, bf16 {total * 2 / MiB:,.1f} MiB",
        *(describe_moe(cfg, groups) if cfg.ffn == "moe" else []),
        "",
        "KV cache = 2 (k, v) * n_layer * n_kv_heads * d_head * bytes per value, per token:",
        f"{'attention':<22}{'n_kv_heads':>11}{'bf16 B/token':>14}{'fp32 B/token':>14}{'bf16, max_seq_len':>18}",
    ]
    rows = [("MHA", cfg.n_heads), ("GQA", cfg.n_kv_heads), ("MQA", 1)]
    for label, n_kv in rows:
        if label == "GQA" and n_kv in (1, cfg.n_heads):
            continue  # this config is MHA or MQA itself
        bf16 = kv_bytes_per_token(cfg, n_kv, 2)
        mark = "  <- this config" if n_kv == cfg.n_kv_heads else ""
        lines.append(
            f"{label:<22}{n_kv:>11}{bf16:>14,}{kv_bytes_per_token(cfg, n_kv, 4):>14,}"
            f"{bf16 * cfg.max_seq_len / 1024:>14,.0f} KiB{mark}"
        )
    return "\n".join(lines)
