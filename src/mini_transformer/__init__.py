"""mini-transformer: a decoder-only Transformer written by hand in PyTorch, stage by stage."""

from .config import PRESETS, TransformerConfig
from .kv_cache import KVCache
from .transformer import TransformerLM

__all__ = ["PRESETS", "KVCache", "TransformerConfig", "TransformerLM", "generate"]


def __getattr__(name):
    if name == "generate":  # generate.py sits above the model; import it only when asked for
        from .generate import generate

        return generate
    raise AttributeError(f"module 'mini_transformer' has no attribute {name!r}")
