"""The model, stages 1, 2 and 8 (docs 01, 02, 02b, 09): read these files in this order.

  layers.py       LayerNorm / RMSNorm, the GELU MLP, SwiGLU
  rope.py         rotary and sinusoidal positions
  cache.py        what the model asks of a cache (begin, attend) and NoCache: the model never imports a cache
  transformer.py  MultiHeadAttention (fused QKV, GQA), TransformerBlock (+ make_norm, make_ffn), TransformerLM
  moe.py          Mixture of Experts: router, top-k, sorted dropless dispatch, load-balancing loss
  quantize.py     int8 / int4 weight-only linears (stage 7, docs 08): a quantized model is still this model
  int4_gemv.py    the int4 GEMV of a decode step (C++ in csrc/, activations rounded to int8) + its reference
  float_gemv.py   the fp32 / bf16 / fp16 GEMV of a CPU decode step (C++ in csrc/, fp32 sums) + its reference
  huge_pages.py   a model's weights moved into 2 MB pages, so a CPU decode step streams them with fewer TLB misses

Attention itself lives one floor down (attention/), checkpoint files beside it (checkpoint/).
"""

from .transformer import TransformerLM

__all__ = ["TransformerLM"]
