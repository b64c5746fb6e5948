"""Exercise answered by the project's own code: the forward of the tiled (FlashAttention) backend."""

import math

from mini_transformer.attention.tiled import tiled_attention_forward


def online_softmax_attention(q, k, v, block_k):
    out, lse = tiled_attention_forward(q, k, v, causal=False, key_padding_mask=None,
                                       scale=1.0 / math.sqrt(q.shape[-1]), block_q=q.shape[2], block_k=block_k)
    return out, lse.to(q.dtype)
