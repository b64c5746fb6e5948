"""What several commands share: `--set key=value` overrides and the model config they give."""

from __future__ import annotations

from ..config import TransformerConfig


def parse_overrides(pairs: list[str] | None) -> dict:
    """--set key=value ... -> {key: value}, values parsed as int, float, bool or string."""
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"--set {pair!r} must look like key=value")
        key, raw = pair.split("=", 1)
        lowered = raw.lower()
        if lowered in ("true", "false"):
            value: object = lowered == "true"
        elif lowered in ("none", "null"):
            value = None
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        out[key] = value
    return out


def config_from_args(args) -> TransformerConfig:
    return TransformerConfig.from_preset(args.preset, **parse_overrides(getattr(args, "set", None)))
