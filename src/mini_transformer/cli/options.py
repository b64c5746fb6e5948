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


DTYPES = ("float32", "bfloat16", "float16")


def add_model_options(p) -> None:
    """--dtype, --quantize and --group-size: the precision a command runs a checkpoint in."""
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="weights and activations (quantized layers keep their codes and fp32 scales)")
    p.add_argument("--quantize", choices=["int8", "int4"], help="weight-only quantize every linear layer first")
    p.add_argument("--group-size", type=int, default=64, help="int4 group size (with --quantize int4)")


def load_model(checkpoint, device, args):
    """The checkpoint (float, or quantized as its save_pretrained wrote it), cast to --dtype, then
    quantized if --quantize asks (quantized layers keep float32 scales whatever --dtype says)."""
    import torch

    from ..model.quantize import quantize
    from ..model.transformer import TransformerLM

    model = TransformerLM.from_pretrained(checkpoint, device=device)
    if args.quantize and getattr(model, "quantization", None):
        raise ValueError(f"--checkpoint {checkpoint} is already quantized; drop --quantize")
    if args.dtype != "float32":
        model = model.to(getattr(torch, args.dtype))
    return quantize(model, args.quantize, group_size=args.group_size) if args.quantize else model
