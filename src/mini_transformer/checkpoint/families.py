"""The one registry of Hugging Face families we import: a row of `FAMILIES` each.

GPT-2 and Llama are rows whose config and tensor-name translations are written out in rules.py. Every
other family is Llama's block (RoPE, RMSNorm, SwiGLU, GQA) plus a few differences, each a named switch
of TransformerConfig, never a special case in the model; its row names only the differences:

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

from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import TransformerConfig
from .rules import LLAMA_FFN_NAMES, Rule, gpt2_config, gpt2_rules, llama_config, llama_rules, llama_values, require

QWEN3_NO_O_BIAS = ("attention_bias", False, "Qwen3's optional o_proj bias has no switch here")
EVERY_LAYER_MOE = ("decoder_sparse_step", 1, "every layer is an MoE layer in our model")


@dataclass(frozen=True)
class Family:
    """What one family changes in Llama's import; everything it does not name is Llama's. A family that is
    not Llama-derived (GPT-2), and Llama itself, give their own `config` and `rules` translations."""

    architecture: str  # architectures[0] in config.json
    config: Callable[..., TransformerConfig] | None = None  # config.json dict -> ours (None: Llama's + the row)
    rules: Callable[[TransformerConfig], list[Rule]] | None = None  # our tensor names <- theirs
    base_prefix: str = "model."  # where *ForCausalLM files keep the base model's tensors

    switches: dict = field(default_factory=dict)  # our config fields the family fixes
    required: tuple = ()  # (config.json key, the one value we support, why)
    window_needs_switch: bool = False  # sliding_window counts only if use_sliding_window is true (Qwen)
    moe: bool = False  # an MoE FFN in every layer
    moe_block: str = "mlp"  # the layer's module that holds the router (`gate`) and the `experts`
    expert_names: tuple = LLAMA_FFN_NAMES  # (our expert matrix, the checkpoint's name for it)
    expert_d_ff_key: str = "intermediate_size"  # the config.json key of one expert's hidden size
    renormalize: bool | None = None  # the top-k weights rescaled to sum 1; None: config.json's norm_topk_prob


FAMILIES = {
    "gpt2": Family("GPT2LMHeadModel", config=gpt2_config, rules=gpt2_rules, base_prefix="transformer."),
    "llama": Family("LlamaForCausalLM", config=llama_config, rules=llama_rules),
    "mistral": Family("MistralForCausalLM"),
    "qwen2": Family("Qwen2ForCausalLM", switches=dict(qkv_bias=True), window_needs_switch=True),
    "qwen3": Family("Qwen3ForCausalLM", switches=dict(qk_norm=True), required=(QWEN3_NO_O_BIAS,),
                    window_needs_switch=True),
    "mixtral": Family("MixtralForCausalLM", moe=True, moe_block="block_sparse_moe", renormalize=True,
                      expert_names=(("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2"))),  # w1 gate, w3 up, w2 down
    "qwen3_moe": Family("Qwen3MoeForCausalLM", switches=dict(qk_norm=True),
                        required=(QWEN3_NO_O_BIAS, EVERY_LAYER_MOE), window_needs_switch=True, moe=True,
                        expert_d_ff_key="moe_intermediate_size"),
}
ARCHITECTURES = {spec.architecture: name for name, spec in FAMILIES.items()}  # architectures[0] -> family


def hf_family(raw: dict) -> str:
    """The FAMILIES key for a supported HF config.json dict; ValueError for anything else."""
    architectures = raw.get("architectures") or []
    if architectures:
        if architectures[0] in ARCHITECTURES:
            return ARCHITECTURES[architectures[0]]
        raise ValueError(
            f"architecture {architectures[0]!r} is not supported; expected one of {', '.join(ARCHITECTURES)}"
        )
    model_type = raw.get("model_type")
    if model_type in ARCHITECTURES.values():
        return model_type
    raise ValueError(
        f"config.json has model_type={model_type!r} and no known architectures; "
        f"expected 'mini-transformer' or a Hugging Face {' / '.join(ARCHITECTURES)} checkpoint"
    )


def context_length(raw: dict, spec: Family, max_len: int) -> int:
    """max_len (config.json's max_position_embeddings), cut to the sliding window when one is in use.

    Mistral v0.1 and Qwen (with use_sliding_window) let each query see only the last `sliding_window`
    keys. Up to that length a sliding window changes nothing, so we import the model with
    max_seq_len = the window and stay exact; beyond it we would need a banded mask we do not have.
    """
    window = raw.get("sliding_window")
    if spec.window_needs_switch and not raw.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window size even when it is switched off
    return min(max_len, window) if window else max_len


def _moe_values(raw: dict, spec: Family) -> dict:
    if raw.get("mlp_only_layers"):
        raise ValueError(f"config.json has mlp_only_layers={raw['mlp_only_layers']!r}; only [] is supported "
                         f"(every layer is an MoE layer in our model)")
    n_experts, k = raw.get("num_local_experts", raw.get("num_experts", 8)), raw.get("num_experts_per_tok", 2)
    renormalize = bool(raw.get("norm_topk_prob", False)) if spec.renormalize is None else spec.renormalize
    return dict(
        ffn="moe", n_experts=n_experts, n_experts_per_tok=k, d_ff=raw.get(spec.expert_d_ff_key, 14336),
        moe_norm_topk_prob=renormalize,
        # HF's balance loss is k times ours (moe.load_balancing_loss), so its coefficient is scaled by k
        moe_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)) * k,
    )


def family_config(raw: dict, family: str, **overrides) -> TransformerConfig:
    """Our TransformerConfig for the config.json of a `family` of FAMILIES."""
    spec = FAMILIES[family]
    if spec.config is not None:
        return spec.config(raw, **overrides)
    for key, expected, why in spec.required:
        require(raw, key, expected, why)
    values = llama_values(raw, default_max_seq_len=32768, default_d_ff=14336)
    # no family here has Llama's bias switch (Qwen3's attention_bias must be False: `required`); the only
    # biases are a row's own switch (Qwen2's qkv_bias)
    values.update(max_seq_len=context_length(raw, spec, values["max_seq_len"]), bias=False, **spec.switches)
    if spec.moe:
        values.update(_moe_values(raw, spec))
    return TransformerConfig.from_dict({**values, **overrides})


def family_rules(cfg: TransformerConfig, family: str) -> list[Rule]:
    """The row's own rules, else Llama's (rules.llama_rules); an MoE family swaps each dense FFN for its
    router and experts."""
    spec = FAMILIES[family]
    if spec.rules is not None:
        return spec.rules(cfg)
    if cfg.ffn != "moe":
        return llama_rules(cfg)

    def moe_rules(cfg: TransformerConfig, i: int) -> list[Rule]:
        block = f"layers.{i}.{spec.moe_block}"
        rules = [Rule(f"blocks.{i}.ffn.router.weight", (f"{block}.gate.weight",))]
        for ours, theirs in spec.expert_names:  # E tensors (out, in) stacked into one (E, out, in)
            sources = tuple(f"{block}.experts.{e}.{theirs}.weight" for e in range(cfg.n_experts))
            rules.append(Rule(f"blocks.{i}.ffn.experts.{ours}.weight", sources, stack=True))
        return rules

    return llama_rules(cfg, ffn_rules=moe_rules)
