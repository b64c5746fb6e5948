"""Import of local Hugging Face checkpoints (config.json + weights) of every family in families.py, no network.

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
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..config import TransformerConfig
from .families import FAMILIES, family_config, family_rules, hf_family
from .rules import GPT2_IGNORED_SUFFIXES, Rule


def config_from_hf(raw: dict, **overrides) -> TransformerConfig:
    """Our TransformerConfig for a HF config.json dict. `overrides` change fields (e.g. attn_backend)."""
    return family_config(raw, hf_family(raw), **overrides)


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
    prefix = FAMILIES[family].base_prefix
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
