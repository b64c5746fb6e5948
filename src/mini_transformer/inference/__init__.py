"""Generating text with the model, stages 3 and 7 (docs 03, 08).

  sampling.py      SamplingParams, greedy / temperature / top-k / top-p / min-p / repetition penalty
  kv_cache.py      KVCache: the contiguous cache of generate()
  generate.py      the decode loop: prefill + one step per token, left-padded batches, EOS, streaming
  decoders.py      what the loop drives: prefill / step over a KVCache, or recomputing without a cache
  static_cache.py  a fixed-shape cache and the decode step compiled once: CompiledDecoder (docs 08)
  cpu_decode.py    that step's CPU backend: matmuls and attention to C++ kernels or reductions
  speculative.py   speculative decoding: a draft model or prompt lookup, the exact acceptance rule
"""

from .generate import generate
from .kv_cache import KVCache
from .sampling import SamplingParams

__all__ = ["KVCache", "SamplingParams", "generate"]
