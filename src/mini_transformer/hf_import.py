"""Import of local Hugging Face GPT-2 and Llama checkpoints (config.json + weights), no network.

Two steps, each small enough to read:
  1. `config_from_hf(raw)`: the HF config.json dict -> our TransformerConfig.
  2. `convert_hf_state(hf_state, raw, expected)`: HF tensor names -> ours, following a list of `Rule`s.
     GPT-2 stores Conv1D weights as (in, out), so they are transposed into nn.Linear's (out, in);
     Llama's separate q/k/v projections are concatenated into our fused W_qkv.
Every HF tensor is checked: a missing, unexpected or mis-shaped one raises ValueError naming it.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .config import TransformerConfig

# architectures[0] in config.json -> our family name (model_type is the fallback when it is absent)
ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama",
                 # the families of hf_families.py (Llama's block plus named switches)
                 "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
# Buffers that old GPT-2 checkpoints carry (the causal mask); they hold no learned values.
GPT2_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def hf_family(raw: dict) -> str:
    """'gpt2' or 'llama' for a supported HF config.json dict; ValueError for anything else."""
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


def _require(raw: dict, name: str, expected, why: str) -> None:
    if raw.get(name, expected) != expected:
        raise ValueError(f"config.json has {name}={raw[name]!r}; only {expected!r} is supported ({why})")


def gpt2_config(raw: dict, **overrides) -> TransformerConfig:
    activation = raw.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise ValueError(f"activation_function={activation!r} is not supported; expected one of "
                         f"{', '.join(GPT2_ACTIVATIONS)}")
    _require(raw, "scale_attn_weights", True, "scores are always divided by sqrt(d_head)")
    _require(raw, "scale_attn_by_inverse_layer_idx", False, "no per-layer score scaling")
    _require(raw, "add_cross_attention", False, "a decoder-only model has no cross-attention")
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
    families of hf_families.py start from these too; the two defaults stand in for a missing
    max_position_embeddings / intermediate_size. head_dim is None when it is d_model / n_heads."""
    _require(raw, "hidden_act", "silu", "the SwiGLU gate is silu")
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


def config_from_hf(raw: dict, **overrides) -> TransformerConfig:
    """Our TransformerConfig for a HF config.json dict. `overrides` change fields (e.g. attn_backend)."""
    family = hf_family(raw)
    if family not in ("gpt2", "llama"):
        from .hf_families import family_config

        return family_config(raw, family, **overrides)
    return {"gpt2": gpt2_config, "llama": llama_config}[family](raw, **overrides)


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
    uses these rules; `ffn_rules(cfg, i)` replaces layer i's dense SwiGLU (hf_families: the MoE ones)."""
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


def source_shapes(rule: Rule, target_shape: tuple[int, ...], cfg: TransformerConfig) -> list[tuple[int, ...]]:
    """The shape each HF source tensor must have to build a target of `target_shape`."""
    if rule.transpose:
        return [tuple(reversed(target_shape))]
    if rule.stack:
        return [target_shape[1:]] * len(rule.sources)
    if len(rule.sources) == 1:
        return [target_shape]
    q_rows, kv_rows = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head  # W_qkv rows: q, then k, then v
    return [(rows, *target_shape[1:]) for rows in (q_rows, kv_rows, kv_rows)]


def base_prefix(state: dict[str, torch.Tensor], family: str) -> str:
    """HF's *LMHeadModel / *ForCausalLM store the base model under `transformer.` (GPT-2) or `model.`
    (Llama); files of the bare base model (like the original hub GPT-2) have no prefix."""
    prefix = "transformer." if family == "gpt2" else "model."
    return prefix if any(name.startswith(prefix) for name in state) else ""


def convert_hf_state(
    hf_state: dict[str, torch.Tensor], raw: dict, cfg: TransformerConfig, expected: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Rename/transpose/concatenate HF tensors into our names. `expected` is our model's state_dict
    (for the target shapes). Raises ValueError for a missing, unexpected or mis-shaped HF tensor."""
    family = hf_family(raw)
    prefix = base_prefix(hf_state, family)
    file_names = {name.removeprefix(prefix): name for name in hf_state}
    state = {short: hf_state[name] for short, name in file_names.items()}

    def in_file(name: str) -> str:  # the name as the checkpoint file spells it, for error messages
        return file_names.get(name, name if name == "lm_head.weight" else prefix + name)

    if family in ("gpt2", "llama"):
        rules = gpt2_rules(cfg) if family == "gpt2" else llama_rules(cfg)
    else:
        from .hf_families import family_rules

        rules = family_rules(cfg, family)
    if cfg.tie_weights:
        state.pop("lm_head.weight", None)  # some files repeat the tied head; the embedding is the source
    else:
        rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
    if family == "gpt2":
        state = {k: v for k, v in state.items() if not k.endswith(GPT2_IGNORED_SUFFIXES)}

    # every (HF name, shape it must have, our target) the model needs
    needed = [(name, shape, rule.target) for rule in rules for name, shape in
              zip(rule.sources, source_shapes(rule, tuple(expected[rule.target].shape), cfg), strict=True)]
    missing = [f"{in_file(name)!r} (expected shape {shape})" for name, shape, _ in needed if name not in state]
    if missing:
        raise ValueError(f"the {family} checkpoint is missing tensors: {', '.join(missing)}")
    extra = sorted(set(state) - {name for name, _, _ in needed})
    if extra:
        listed = ", ".join(f"{in_file(name)!r} (shape {tuple(state[name].shape)})" for name in extra)
        raise ValueError(f"the {family} checkpoint has unexpected tensors the model has no place for: {listed}")
    for name, shape, target in needed:
        if tuple(state[name].shape) != shape:
            raise ValueError(f"tensor {in_file(name)!r} has shape {tuple(state[name].shape)} in the checkpoint but "
                             f"the model needs {shape} (for {target!r})")

    converted = {}
    for rule in rules:
        parts = [state[name] for name in rule.sources]
        tensor = parts[0].t() if rule.transpose else torch.stack(parts) if rule.stack else torch.cat(parts, dim=0)
        converted[rule.target] = tensor.contiguous()
    return converted


def _read_weight_file(file: Path) -> dict[str, torch.Tensor]:
    """One safetensors or pickle-free torch file; ValueError naming it when it cannot be read."""
    try:
        if file.suffix == ".safetensors":
            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    except (SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError, OSError) as err:
        raise ValueError(f"{file} cannot be read ({type(err).__name__}: {err})") from None


def weight_files(path: Path, weights_name: str) -> list[Path]:
    """The files holding `weights_name`: itself, or the shards its `.index.json` names. Every named file
    must lie inside `path` (a crafted index must not make us read elsewhere)."""
    index = path / f"{weights_name}.index.json"
    if not index.is_file():
        return [path / weights_name] if (path / weights_name).is_file() else []
    try:
        weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{index} is not a valid index: expected JSON with a 'weight_map' object ({err})") from None
    files = []
    for name in names:  # checked by name, not by resolving links: HF's cache links each file to a blob
        parts = Path(str(name)).parts
        if not parts or Path(str(name)).is_absolute() or ".." in parts:
            raise ValueError(f"{index} names {name!r}, which lies outside the checkpoint directory {path}")
        files.append(path / str(name))
    return files


def read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF directory: model.safetensors, pytorch_model.bin, or their sharded *.index.json."""
    for weights_name in ("model.safetensors", "pytorch_model.bin"):
        files = weight_files(path, weights_name)
        state = {}
        for file in files:
            state.update(_read_weight_file(file))
        if files:
            return state
    raise ValueError(f"path={str(path)!r} has no model.safetensors or pytorch_model.bin (nor a sharded index)")
