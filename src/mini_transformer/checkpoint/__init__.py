"""Checkpoint files: our own format (config.json + model.safetensors + manifest.json, and
quantization.json for a quantized model), and the reader that also takes local Hugging Face directories
(their translation lives in hf.py, families.py and rules.py).

This package speaks TransformerConfig and state dicts; it never imports the model. TransformerLM's
`from_pretrained` / `save_pretrained` call down into `read_checkpoint` / `write_checkpoint` and hand in a
factory that builds (and, for a quantized checkpoint, quantizes) the model, so data flows one way:
model -> checkpoint -> config.

Integrity: every directory we write ends with `manifest.json`, the size and sha256 of each file in it,
written last. Loading checks the manifest before reading anything else and refuses NaN / inf weights,
so a damaged file is named instead of silently decoding junk.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .._checks import path_like
from ..config import TransformerConfig
from .hf import config_from_hf, convert_hf_state, read_hf_weights

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MANIFEST_NAME = "manifest.json"
QUANT_CONFIG_NAME = "quantization.json"  # a quantized model's mode, group size and skipped layers
MODEL_TYPE = "mini-transformer"
CHECKPOINT_NAMES = ("best", "last")  # the two checkpoints of a run directory


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or differs from what its manifest recorded."""


def clean_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the `_orig_mod.` (torch.compile) and `module.` (DDP) prefixes from parameter names."""
    cleaned = {}
    prefixes = ("_orig_mod.", "module.")
    for name, tensor in state_dict.items():
        while name.startswith(prefixes):  # in any order and any number: DDP(compile(model)) gives both
            name = name.split(".", 1)[1]
        cleaned[name] = tensor
    return cleaned


# ------------------------------------------------------------------------------------ the manifest
def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(directory: str | Path) -> None:
    """Record the size and sha256 of every file in `directory`. Call it after the last file is written."""
    directory = Path(directory)
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    entries = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in files}
    (directory / MANIFEST_NAME).write_text(json.dumps({"files": entries}, indent=2))


def read_json(path: Path) -> dict:
    """A JSON object from `path`; CheckpointError naming the file when it is not one."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}; expected an object")
    return value


def verify_manifest(directory: Path) -> None:
    """Every file the manifest lists is there with its recorded size and sha256, else CheckpointError."""
    manifest = directory / MANIFEST_NAME
    if not manifest.is_file():
        raise CheckpointError(f"{manifest} is missing, so the checkpoint's files cannot be verified "
                              f"(mini-transformer writes one into every checkpoint; for one saved before "
                              f"manifests existed, and known to be sound: python -c \"from mini_transformer."
                              f"checkpoint import write_manifest; write_manifest('{directory}')\")")
    entries = read_json(manifest).get("files")
    if not isinstance(entries, dict) or not all(isinstance(e, dict) for e in entries.values()):
        raise CheckpointError(f"{manifest} has no 'files' table of {{name: {{bytes, sha256}}}}")
    for name, entry in entries.items():
        path = directory / name
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{manifest} lists {name!r}, which is not a file name inside the checkpoint")
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (it is listed in {MANIFEST_NAME})")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise CheckpointError(f"{path} has {size} bytes but {MANIFEST_NAME} recorded {entry.get('bytes')} "
                                  f"(truncated or overwritten)")
        if file_sha256(path) != entry.get("sha256"):
            raise CheckpointError(f"{path} does not match the sha256 recorded in {MANIFEST_NAME} (damaged)")


def previous_dir(path: Path) -> Path:
    """Where a save keeps the previous checkpoint between its two renames (see train_io.save_checkpoint)."""
    return path.with_name(f".{path.name}.old")


def resolve_checkpoint_dir(path: str | Path, run_checkpoints: tuple[str, ...] = ("best",), *,
                           say: bool = True) -> Path:
    """The checkpoint directory that `path` names:
    - a run directory (`train`'s --out: no config.json of its own) means its first checkpoint among
      `run_checkpoints` that exists (`best` to load a model, `last` then `best` to resume); unless `say` is
      False, a line on stderr says which one, so a user who typed the run directory knows what was loaded;
    - a checkpoint missing for a moment because a kill fell between the two renames of a save means the
      previous one, still under its `.NAME.old` name."""
    path = Path(path)
    if not path.exists() and previous_dir(path).is_dir():
        return previous_dir(path)
    if path.is_dir() and not (path / CONFIG_NAME).exists() and not (path / MANIFEST_NAME).exists():
        for name in run_checkpoints:
            checkpoint = resolve_checkpoint_dir(path / name)
            if checkpoint.is_dir():
                if say:
                    print(f"{path} is a run directory: loading its {name} checkpoint {checkpoint}", file=sys.stderr)
                return checkpoint
    return path


def verify_checkpoint(path: Path) -> None:
    """verify_manifest, with a pointer to the run's other checkpoint (best <-> last) when that one is sound."""
    try:
        verify_manifest(path)
    except CheckpointError as err:
        name = path.name.removeprefix(".").removesuffix(".old")
        if name in CHECKPOINT_NAMES:
            other = path.parent / CHECKPOINT_NAMES[1 - CHECKPOINT_NAMES.index(name)]
            try:
                verify_manifest(resolve_checkpoint_dir(other))
            except CheckpointError:
                raise err from None
            raise CheckpointError(f"{err}; the run's other checkpoint {other} passes its checks: use it") from None
        raise


# ---------------------------------------------------------------------------------- write and read
def head_is_embedding(state: dict[str, torch.Tensor]) -> bool:
    """Whether `state`'s lm_head.weight IS tok_emb.weight (a tied head: one storage). A tied config is not
    enough: quantize() gives a tied head its own int8 / int4 copy, and that copy must be saved."""
    head, embedding = state.get("lm_head.weight"), state.get("tok_emb.weight")
    return (head is not None and embedding is not None and head.data_ptr() == embedding.data_ptr()
            and head.shape == embedding.shape)


def write_checkpoint(path: str | Path, config: TransformerConfig, state_dict: dict[str, torch.Tensor], *,
                     quantization: dict | None = None, manifest: bool = True) -> None:
    """Write config.json, model.safetensors and manifest.json. A tied head is stored once (as tok_emb.weight);
    a quantized copy of it (see head_is_embedding) is stored as lm_head.weight. A quantized model's
    settings (`model.quantization`: mode, group size, skipped layers) go to quantization.json.

    The old manifest goes first and the new one comes last, so a save killed half-way leaves a
    directory that loading refuses instead of one that mixes two models. `manifest=False` leaves it
    to the caller, who adds more files first."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MANIFEST_NAME).unlink(missing_ok=True)
    state = clean_state_dict(state_dict)
    if config.tie_weights and head_is_embedding(state):
        state.pop("lm_head.weight")
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(path / WEIGHTS_NAME))
    (path / CONFIG_NAME).write_text(json.dumps({"model_type": MODEL_TYPE, **config.to_dict()}, indent=2))
    (path / QUANT_CONFIG_NAME).unlink(missing_ok=True)  # a float model saved over a quantized one
    if quantization:
        (path / QUANT_CONFIG_NAME).write_text(json.dumps(quantization, indent=2))
    if manifest:
        write_manifest(path)


def load_state_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into `model`, raising ValueError on a missing, extra or mis-shaped tensor."""
    state = clean_state_dict(state)
    expected = model.state_dict()
    if head_is_embedding(expected):  # a tied head is filled through tok_emb.weight
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


def check_finite(state: dict[str, torch.Tensor], path: Path) -> None:
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{path}: tensor {name!r} holds NaN or inf values; refusing to load it")


def read_quantization(path: Path) -> dict | None:
    """The settings write_checkpoint wrote next to a quantized model's weights, or None for a float one."""
    file = path / QUANT_CONFIG_NAME
    if not file.is_file():
        return None
    settings = read_json(file)
    if not {"mode", "group_size"} <= settings.keys():
        raise CheckpointError(f"{file} has keys {sorted(settings)}; expected at least 'mode' and 'group_size'")
    return settings


def read_config(path: str | Path, **overrides) -> TransformerConfig:
    """The config a checkpoint directory (ours or Hugging Face's) loads with, without reading weights:
    the same rules as read_checkpoint (a HF directory attends with "sdpa" unless overridden)."""
    raw = read_json(resolve_checkpoint_dir(path) / CONFIG_NAME)
    if raw.get("model_type") == MODEL_TYPE:
        raw.pop("model_type", None)
        return TransformerConfig.from_dict({**raw, **overrides})
    return config_from_hf(raw, **{"attn_backend": "sdpa", **overrides})


def read_checkpoint(path: str | Path, make_model: Callable[[TransformerConfig, dict | None], torch.nn.Module],
                    **overrides) -> torch.nn.Module:
    """Build a model with `make_model(config, quantization)` and fill it from a directory written by
    `write_checkpoint` or from a local Hugging Face directory. Never touches the network.

    `quantization` is None for a float checkpoint, else the settings of quantization.json: the factory
    swaps in the quantized linears, so the saved tensors fit them (this module never builds a model).
    Ours must pass its manifest; a HF directory (no manifest) may name only files inside itself.
    `overrides` change config fields (e.g. attn_backend="naive"). Ours keep the attention backend they
    were saved with; a HF directory attends with the fast exact "sdpa" unless told otherwise (as
    transformers does), not our config's default "naive", the float64-style teaching reference."""
    path_like("path", path, "a directory path")
    path = resolve_checkpoint_dir(path)
    has_manifest = (path / MANIFEST_NAME).exists()
    if has_manifest:
        verify_checkpoint(path)  # first: a damaged file is named before anything reads it
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise ValueError(f"path={str(path)!r} has no {CONFIG_NAME}; expected a checkpoint directory "
                         f"(or a run directory holding {CHECKPOINT_NAMES[0]}/)")
    raw = read_json(config_file)
    ours = raw.get("model_type") == MODEL_TYPE
    if ours and not has_manifest:
        verify_checkpoint(path)  # names the missing manifest, and the run's other checkpoint if sound
    if ours:
        raw.pop("model_type", None)
        model = make_model(TransformerConfig.from_dict({**raw, **overrides}), read_quantization(path))
        weights = path / WEIGHTS_NAME
        if not weights.is_file():
            raise CheckpointError(f"{weights} is missing; expected the weights next to {CONFIG_NAME}")
        try:
            state = load_file(str(weights))
        except SafetensorError as err:
            raise CheckpointError(f"{weights} cannot be read ({err})") from None
    else:  # a Hugging Face directory: an unknown architecture raises ValueError here
        model = make_model(config_from_hf(raw, **{"attn_backend": "sdpa", **overrides}), None)
        state = convert_hf_state(read_hf_weights(path), raw, model.config, model.state_dict())
    check_finite(state, path)
    load_state_into(model, state)
    return model
