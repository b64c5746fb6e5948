"""Saving and loading weights: our own format (model.safetensors + config.json)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import TransformerConfig
from .transformer import TransformerLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def clean_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the `_orig_mod.` (torch.compile) and `module.` (DDP) prefixes from parameter names."""
    cleaned = {}
    prefixes = ("_orig_mod.", "module.")
    for name, tensor in state_dict.items():
        while name.startswith(prefixes):  # in any order and any number: DDP(compile(model)) gives both
            name = name.split(".", 1)[1]
        cleaned[name] = tensor
    return cleaned


def save_pretrained(model: TransformerLM, path: str | Path) -> None:
    """Write config.json and model.safetensors. A tied head is stored once (as tok_emb.weight)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = getattr(model, "_orig_mod", model)
    state = clean_state_dict(model.state_dict())
    if model.config.tie_weights:
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(path / WEIGHTS_NAME))
    (path / CONFIG_NAME).write_text(json.dumps({"model_type": "mini-transformer", **model.config.to_dict()}, indent=2))


def load_state_into(model: TransformerLM, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into `model`, raising ValueError on a missing, extra or mis-shaped tensor."""
    state = clean_state_dict(state)
    expected = model.state_dict()
    if model.config.tie_weights:
        expected.pop("lm_head.weight", None)
        state.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"checkpoint does not match the model: missing tensors {missing}, unexpected tensors {extra}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)} in the checkpoint but "
                f"{tuple(expected[name].shape)} in the model"
            )
    model.load_state_dict(state, strict=False)


def load_pretrained(path: str | Path, *, device: str | torch.device = "cpu", **overrides) -> TransformerLM:
    """Load a directory written by `save_pretrained`. `overrides` change config fields (e.g. attn_backend)."""
    path = Path(path)
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise ValueError(f"path={str(path)!r} has no {CONFIG_NAME}; expected a checkpoint directory")
    raw = json.loads(config_file.read_text())
    model_type = raw.pop("model_type", None)
    if model_type != "mini-transformer":
        raise ValueError(f"{config_file} has model_type={model_type!r}; expected 'mini-transformer'")
    model = TransformerLM(TransformerConfig.from_dict({**raw, **overrides}))
    load_state_into(model, load_file(str(path / WEIGHTS_NAME)))
    return model.to(device)
