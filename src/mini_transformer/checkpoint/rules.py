"""The two base translations every Hugging Face import starts from: GPT-2's and Llama's config fields and
tensor names (`Rule`s). A leaf: families.py builds every family's row from these, hf.py applies the rules.

A `Rule` says how one of our tensors is made from HF tensors: copied, transposed (GPT-2's Conv1D stores
(in, out)), concatenated along dim 0 (Llama's q, k, v -> our fused W_qkv) or stacked (MoE experts).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TransformerConfig

GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
# Buffers that old GPT-2 checkpoints carry (the causal mask); they hold no learned values.
GPT2_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def require(raw: dict, name: str, expected, why: str) -> None:
    if raw.get(name, expected) != expected:
        raise ValueError(f"config.json has {name}={raw[name]!r}; only {expected!r} is supported ({why})")


def gpt2_config(raw: dict, **overrides) -> TransformerConfig:
    activation = raw.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise ValueError(f"activation_function={activation!r} is not supported; expected one of "
                         f"{', '.join(GPT2_ACTIVATIONS)}")
    require(raw, "scale_attn_weights", True, "scores are always divided by sqrt(d_head)")
    require(raw, "scale_attn_by_inverse_layer_idx", False, "no per-layer score scaling")
    require(raw, "add_cross_attention", False, "a decoder-only model has no cross-attention")
    d_model = raw.get("n_embd", 768)
    values = dict(
        vocab_size=raw.get("vocab_size", 50257), d_model=d_model, n_heads=raw.get("n_head", 12),
        n_layer=raw.get("n_layer", 12), max_seq_len=raw.get("n_positions", 1024),
        d_ff=raw.get("n_inner") or 4 * d_model, ffn=GPT2_ACTIVATIONS[activation],
        norm_eps=raw.get("layer_norm_epsilon", 1e-5), pos_emb="learned", norm="layernorm", bias=True,
        tie_weights=raw.get("tie_word_embeddings", True), attn_pdrop=raw.get("attn_pdrop", 0.0),
        resid_pdrop=raw.get("resid_pdrop", 0.0), embd_pdrop=raw.get("embd_pdrop", 0.0),
    )
    return TransformerConfig.from_dict({**values, **overrides})


def llama_rope_theta(raw: dict) -> float:
    """rope_theta sits in `rope_parameters` (transformers >= 5) or at the top level (older configs)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} (RoPE scaling) is not supported; expected 'default'")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


LLAMA_FFN_NAMES = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))  # ours, Llama's


def llama_values(raw: dict, default_max_seq_len: int = 2048, default_d_ff: int = 11008) -> dict:
    """Our config fields for Llama's block (RoPE, RMSNorm, SwiGLU, GQA) from a config.json dict. The
    families of families.py start from these too; the two defaults stand in for a missing
    max_position_embeddings / intermediate_size. head_dim is None when it is d_model / n_heads."""
    require(raw, "hidden_act", "silu", "the SwiGLU gate is silu")
    d_model, n_heads = raw.get("hidden_size", 4096), raw.get("num_attention_heads", 32)
    head_dim = raw.get("head_dim") or d_model // n_heads
    attention_bias, mlp_bias = raw.get("attention_bias", False), raw.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ValueError(f"attention_bias={attention_bias} and mlp_bias={mlp_bias} differ; "
                         f"expected both equal (our config has one `bias` switch)")
    return dict(
        vocab_size=raw.get("vocab_size", 32000), d_model=d_model, n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads, n_layer=raw.get("num_hidden_layers", 32),
        max_seq_len=raw.get("max_position_embeddings", default_max_seq_len),
        d_ff=raw.get("intermediate_size", default_d_ff),
        pos_emb="rope", rope_theta=llama_rope_theta(raw), norm="rmsnorm", norm_eps=raw.get("rms_norm_eps", 1e-6),
        ffn="swiglu", bias=bool(attention_bias), tie_weights=raw.get("tie_word_embeddings", False),
        attn_pdrop=float(raw.get("attention_dropout", 0.0)),
        head_dim=None if head_dim * n_heads == d_model else head_dim,
    )


def llama_config(raw: dict, **overrides) -> TransformerConfig:
    values = llama_values(raw)
    if values["head_dim"] is not None:  # Llama's own class always has head_dim = hidden_size / heads
        raise ValueError(f"head_dim={values['head_dim']} with num_attention_heads={values['n_heads']} does not "
                         f"give hidden_size={values['d_model']}; expected head_dim = hidden_size / num_attention_heads")
    return TransformerConfig.from_dict({**values, **overrides})


@dataclass(frozen=True)
class Rule:
    """Our tensor `target` is built from HF `sources`: one tensor (optionally transposed) or several
    concatenated along dim 0 (Llama q, k, v -> W_qkv), or stacked along a new dim 0 (MoE experts)."""

    target: str
    sources: tuple[str, ...]
    transpose: bool = False
    stack: bool = False


def gpt2_rules(cfg: TransformerConfig) -> list[Rule]:
    rules = [Rule("tok_emb.weight", ("wte.weight",)), Rule("pos_emb.weight", ("wpe.weight",))]
    pairs = [("norm_1", "ln_1", False), ("attn.W_qkv", "attn.c_attn", True), ("attn.W_o", "attn.c_proj", True),
             ("norm_2", "ln_2", False), ("ffn.fc1", "mlp.c_fc", True), ("ffn.fc2", "mlp.c_proj", True)]
    for i in range(cfg.n_layer):
        for ours, theirs, is_conv1d in pairs:
            rules.append(Rule(f"blocks.{i}.{ours}.weight", (f"h.{i}.{theirs}.weight",), transpose=is_conv1d))
            rules.append(Rule(f"blocks.{i}.{ours}.bias", (f"h.{i}.{theirs}.bias",)))
    rules += [Rule("norm_f.weight", ("ln_f.weight",)), Rule("norm_f.bias", ("ln_f.bias",))]
    return rules


def llama_rules(cfg: TransformerConfig, ffn_rules=None) -> list[Rule]:
    """Our tensor names <- Llama's (without the `model.` prefix); the head is added by the caller. The
    config's switches decide the optional tensors (biases, q/k norms), so every family of Llama's block
    uses these rules; `ffn_rules(cfg, i)` replaces layer i's dense SwiGLU (families.py: the MoE ones)."""
    rules = [Rule("tok_emb.weight", ("embed_tokens.weight",))]
    for i in range(cfg.n_layer):
        rules += _llama_attention_rules(cfg, i)
        rules += (ffn_rules or _llama_mlp_rules)(cfg, i)
    rules.append(Rule("norm_f.weight", ("norm.weight",)))
    return rules


def _kinds(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


def _llama_attention_rules(cfg: TransformerConfig, i: int) -> list[Rule]:
    """Layer i's two norms and its attention: q, k, v concatenated into W_qkv, o_proj, maybe q/k norms."""
    hf = f"layers.{i}"
    rules = [Rule(f"blocks.{i}.norm_1.weight", (f"{hf}.input_layernorm.weight",)),
             Rule(f"blocks.{i}.norm_2.weight", (f"{hf}.post_attention_layernorm.weight",))]
    for kind in _kinds(cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias):
        rules.append(Rule(f"blocks.{i}.attn.W_qkv.{kind}", tuple(f"{hf}.self_attn.{p}_proj.{kind}" for p in "qkv")))
    for kind in _kinds(cfg.bias):
        rules.append(Rule(f"blocks.{i}.attn.W_o.{kind}", (f"{hf}.self_attn.o_proj.{kind}",)))
    if cfg.qk_norm:
        for name in ("q_norm", "k_norm"):
            rules.append(Rule(f"blocks.{i}.attn.{name}.weight", (f"{hf}.self_attn.{name}.weight",)))
    return rules


def _llama_mlp_rules(cfg: TransformerConfig, i: int) -> list[Rule]:
    return [Rule(f"blocks.{i}.ffn.{ours}.{kind}", (f"layers.{i}.mlp.{theirs}.{kind}",))
            for kind in _kinds(cfg.bias) for ours, theirs in LLAMA_FFN_NAMES]
