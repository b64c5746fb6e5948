"""Exercise answered by the project's own code: the naive backend of attention()."""

from mini_transformer.attention import attention as project_attention


def attention(q, k, v, keep=None, causal=True):
    return project_attention(q, k, v, causal=causal, key_padding_mask=keep, backend="naive")
