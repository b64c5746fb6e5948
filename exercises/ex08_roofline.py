"""Exercise (docs/08a sections 1 and 1b): the roofline of one decode step, by arithmetic.

Fill in the functions below, then grade them:

    uv run pytest exercises/test_ex08_roofline.py

A decode step of `batch` sequences, each with `context` tokens already cached, adds one token to each. It
reads every weight once (whatever the batch) and each sequence's K/V; it does a multiply and an add per
weight per sequence, plus the attention over the keys. Nothing else is counted (activations, the softmax).
Bytes are plain counts (bytes_per_value: 4 for fp32, 2 for bf16); bandwidth is in bytes/s, peak in FLOP/s.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    """A Llama-layout decoder: per layer an RMSNorm, attention with q, k, v, o projections (GQA: n_kv_heads
    heads for k and v), an RMSNorm and a SwiGLU MLP (gate, up, down); a final RMSNorm; an output head of its
    own (not tied to the embedding). RoPE, so no position table. No biases anywhere."""

    vocab_size: int
    d_model: int
    n_layer: int
    n_heads: int
    n_kv_heads: int
    d_ff: int

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads


def linear_params(m: Model) -> int:
    """Weights of every linear layer: all layers' projections and MLPs, and the output head."""
    # TODO 1: list each matrix of one layer with its shape; the output head maps d_model to the vocabulary
    raise NotImplementedError("TODO: ex08_roofline, linear_params")


def weight_bytes(m: Model, bytes_per_value: int) -> int:
    """Bytes of weights one decode step reads."""
    # TODO 2: the linear layers, every norm's scale, and of the embedding table only what one token looks up
    raise NotImplementedError("TODO: ex08_roofline, weight_bytes")


def kv_bytes_per_token(m: Model, bytes_per_value: int) -> int:
    """Bytes the KV cache holds for one token (all layers)."""
    # TODO 3: what one token leaves in the cache, in every layer
    raise NotImplementedError("TODO: ex08_roofline, kv_bytes_per_token")


def step_flops(m: Model, batch: int, context: int) -> int:
    """FLOPs of one decode step: the linear layers, plus q·k and p·v over the context + 1 keys of every
    query head (the new token attends to itself too)."""
    # TODO 4
    raise NotImplementedError("TODO: ex08_roofline, step_flops")


def step_bytes(m: Model, batch: int, context: int, bytes_per_value: int) -> int:
    """Bytes one decode step reads: the weights, and the K/V of every sequence's context + 1 keys."""
    # TODO 5
    raise NotImplementedError("TODO: ex08_roofline, step_bytes")


def max_tokens_per_s(m: Model, context: int, bytes_per_value: int, bandwidth: float) -> float:
    """The bandwidth ceiling at batch 1: the most tokens per second a step that reads step_bytes can make."""
    # TODO 6
    raise NotImplementedError("TODO: ex08_roofline, max_tokens_per_s")


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The arithmetic intensity (FLOP per byte) where the bandwidth roof meets the compute roof."""
    # TODO 7
    raise NotImplementedError("TODO: ex08_roofline, ridge_point")


def ridge_batch(m: Model, context: int, bytes_per_value: int, peak_flops: float, bandwidth: float) -> int | None:
    """The smallest batch whose step reaches the ridge point (is compute-bound); None when no batch ever does.

    Mind what grows with the batch and what does not: may the intensity climb without limit?"""
    # TODO 8: the intensity of a step is step_flops / step_bytes
    raise NotImplementedError("TODO: ex08_roofline, ridge_batch")
