"""Hugging Face import for the families people download today: Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE.

Each is Llama's block (RoPE, RMSNorm, SwiGLU, GQA) plus a few differences, and each difference is a
named switch of TransformerConfig, never a special case in the model:

    family      architecture            differences from Llama -> our switches
    mistral     MistralForCausalLM      none in the block (sliding window: see `context_length`)
    qwen2       Qwen2ForCausalLM        biases on q/k/v only                 -> qkv_bias=True
    qwen3       Qwen3ForCausalLM        RMSNorm on each head's q and k;      -> qk_norm=True
                                        head_dim apart from d_model / H      -> head_dim
    mixtral     MixtralForCausalLM      a top-2-of-8 MoE FFN, renormalised   -> ffn="moe", moe_norm_topk_prob=True
    qwen3_moe   Qwen3MoeForCausalLM     Qwen3 attention + an MoE FFN         -> ffn="moe", moe_norm_topk_prob

Checkpoints store every expert as its own tensors (`experts.{e}.w1.weight` in Mixtral,
`experts.{e}.gate_proj.weight` in Qwen3-MoE); they are stacked into our (E, out, in) expert weights.
"""

from __future__ import annotations

from .config import TransformerConfig
from .hf_import import Rule, _require, llama_rope_theta

MOE_FAMILIES = ("mixtral", "qwen3_moe")
QWEN_FAMILIES = ("qwen2", "qwen3", "qwen3_moe")


def context_length(raw: dict, family: str) -> int:
    """max_position_embeddings, cut to the sliding window when one is in use.

    Mistral v0.1 and Qwen (with use_sliding_window) let each query see only the last `sliding_window`
    keys. Up to that length a sliding window changes nothing, so we import the model with
    max_seq_len = the window and stay exact; beyond it we would need a banded mask we do not have.
    """
    max_len = raw.get("max_position_embeddings", 32768)
    window = raw.get("sliding_window")
    if family in QWEN_FAMILIES and not raw.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window size even when it is switched off
    return min(max_len, window) if window else max_len


def _moe_values(raw: dict, family: str) -> dict:
    if family == "qwen3_moe":
        _require(raw, "decoder_sparse_step", 1, "every layer is an MoE layer in our model")
        if raw.get("mlp_only_layers"):
            raise ValueError(f"config.json has mlp_only_layers={raw['mlp_only_layers']!r}; only [] is supported "
                             f"(every layer is an MoE layer in our model)")
    n_experts, k = raw.get("num_local_experts", raw.get("num_experts", 8)), raw.get("num_experts_per_tok", 2)
    return dict(
        ffn="moe", n_experts=n_experts, n_experts_per_tok=k,
        d_ff=raw["moe_intermediate_size"] if family == "qwen3_moe" else raw.get("intermediate_size", 14336),
        moe_norm_topk_prob=True if family == "mixtral" else bool(raw.get("norm_topk_prob", False)),
        # HF's balance loss is k times ours (moe.load_balancing_loss), so its coefficient is scaled by k
        moe_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)) * k,
    )


def family_config(raw: dict, family: str, **overrides) -> TransformerConfig:
    """Our TransformerConfig for the config.json of mistral, qwen2, qwen3, mixtral or qwen3_moe."""
    _require(raw, "hidden_act", "silu", "the SwiGLU gate is silu")
    if family in ("qwen3", "qwen3_moe"):
        _require(raw, "attention_bias", False, "Qwen3's optional o_proj bias has no switch here")
    d_model, n_heads = raw.get("hidden_size", 4096), raw.get("num_attention_heads", 32)
    head_dim = raw.get("head_dim") or d_model // n_heads
    values = dict(
        vocab_size=raw.get("vocab_size", 32000), d_model=d_model, n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads, n_layer=raw.get("num_hidden_layers", 32),
        max_seq_len=context_length(raw, family), d_ff=raw.get("intermediate_size", 14336),
        pos_emb="rope", rope_theta=llama_rope_theta(raw), norm="rmsnorm", norm_eps=raw.get("rms_norm_eps", 1e-6),
        ffn="swiglu", bias=False, tie_weights=raw.get("tie_word_embeddings", False),
        attn_pdrop=float(raw.get("attention_dropout", 0.0)),
        head_dim=None if head_dim * n_heads == d_model else head_dim,
        qkv_bias=True if family == "qwen2" else None,
        qk_norm=family in ("qwen3", "qwen3_moe"),
    )
    if family in MOE_FAMILIES:
        values.update(_moe_values(raw, family))
    return TransformerConfig.from_dict({**values, **overrides})


def _ffn_rules(cfg: TransformerConfig, family: str, i: int) -> list[Rule]:
    hf = f"layers.{i}"
    if cfg.ffn != "moe":
        pairs = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
        return [Rule(f"blocks.{i}.ffn.{ours}.weight", (f"{hf}.mlp.{theirs}.weight",)) for ours, theirs in pairs]
    if family == "mixtral":  # Mixtral's names: w1 = gate, w3 = up, w2 = down
        block, pairs = "block_sparse_moe", (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2"))
    else:
        block, pairs = "mlp", (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
    rules = [Rule(f"blocks.{i}.ffn.router.weight", (f"{hf}.{block}.gate.weight",))]
    for ours, theirs in pairs:  # E tensors (out, in) stacked into one (E, out, in)
        sources = tuple(f"{hf}.{block}.experts.{e}.{theirs}.weight" for e in range(cfg.n_experts))
        rules.append(Rule(f"blocks.{i}.ffn.experts.{ours}.weight", sources, stack=True))
    return rules


def family_rules(cfg: TransformerConfig, family: str) -> list[Rule]:
    """Our tensor names <- the checkpoint's (without the `model.` prefix); the head is added by the caller."""
    rules = [Rule("tok_emb.weight", ("embed_tokens.weight",))]
    for i in range(cfg.n_layer):
        hf = f"layers.{i}"
        rules.append(Rule(f"blocks.{i}.norm_1.weight", (f"{hf}.input_layernorm.weight",)))
        rules.append(Rule(f"blocks.{i}.norm_2.weight", (f"{hf}.post_attention_layernorm.weight",)))
        kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
        for kind in kinds:
            rules.append(Rule(f"blocks.{i}.attn.W_qkv.{kind}", tuple(f"{hf}.self_attn.{p}_proj.{kind}" for p in "qkv")))
        rules.append(Rule(f"blocks.{i}.attn.W_o.weight", (f"{hf}.self_attn.o_proj.weight",)))
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                rules.append(Rule(f"blocks.{i}.attn.{name}.weight", (f"{hf}.self_attn.{name}.weight",)))
        rules += _ffn_rules(cfg, family, i)
    rules.append(Rule("norm_f.weight", ("norm.weight",)))
    return rules
