"""Exercise answered by the project's own code: mini_transformer.model.rope."""

from mini_transformer.model import rope


def rope_tables(positions, d_head, theta=10000.0):
    cos, sin = rope.rope_tables(int(positions.max()) + 1, d_head, theta)  # (max_pos + 1, D)
    return cos[positions], sin[positions]


def rotate_half(x):
    return rope.rotate_half(x)


def apply_rope(q, k, positions, theta=10000.0):
    cos, sin = rope_tables(positions, q.shape[-1], theta)  # (T, D)
    cos, sin = cos.to(q.dtype)[None, None], sin.to(q.dtype)[None, None]  # (1, 1, T, D)
    return rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)

