"""Exercise answered by the project's own code: kv_cache.KVCache and decoders.decode_step."""

from mini_transformer.inference.decoders import decode_step
from mini_transformer.inference.kv_cache import KVCache

__all__ = ["KVCache", "decode_step"]
