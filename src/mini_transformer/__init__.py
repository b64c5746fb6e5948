"""mini-transformer: a decoder-only Transformer written by hand in PyTorch, stage by stage."""

from .config import PRESETS, TransformerConfig

# `generate` is imported eagerly on purpose: with a lazy module __getattr__, importing the submodule
# `mini_transformer.inference.generate` rebinds the package attribute `generate` to the module, and
# `from mini_transformer import generate` then returned the module instead of the function.
from .inference.generate import generate
from .inference.kv_cache import KVCache
from .inference.sampling import SamplingParams
from .model.transformer import TransformerLM

__all__ = ["PRESETS", "KVCache", "SamplingParams", "TransformerConfig", "TransformerLM", "generate"]
