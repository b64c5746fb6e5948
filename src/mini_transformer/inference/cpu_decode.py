"""The CPU backend of the compiled decode step (static_cache.compiled_decode_step): inductor, with three rules.

At batch 1 a decode step reads every weight once and does one multiply-add per weight: its time is the time
to stream the weights (and K/V) in. aten's CPU kernels for the step's two heavy ops stream well below
that speed when called with one row - MKL's one-row addmm, and the CPU flash attention, built for many
queries. So the backend replaces them while inductor traces the step:

  * mm / addmm with at most 8 rows -> model/float_gemv.py's C++ GEMV (fp32, bf16, fp16 on a CPU with
    AVX-512 or AVX2; the weight read front to back once, sums in fp32, one rounding); without it, ONE row becomes
    multiply + sum, a GEMV inductor writes in C++ itself (`_one_row_addmm`, `_one_row_mm`);
  * attention for one query -> attention/one_query_cpu.py's C++ kernel, which skips the slab's masked
    slots (`_one_query_kernel_takes` says when); else the same as reductions (`_one_query_attention`);
  * int8 weights: each linear's input stored once instead of recomputed per weight (a config patch).

The rules reach inductor as its decomposition table (`DecodeDecompositions`), for this backend's compiles only.
`GraphReplay` calls the compiled graph of one (model, cache) without dynamo from its second step on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..attention import one_query_cpu
from ..model import float_gemv

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _one_row_addmm(bias, mat1, mat2, beta=1, alpha=1):
    """addmm of a few rows (M <= 8, a decode step's batch) @ an nn.Linear weight: model/float_gemv.py's C++
    GEMV (fp32, bf16, fp16 on a CPU with AVX-512 or AVX2; the weight read front to back once, sums in fp32, rounded
    once). Elsewhere ONE row (1, K) @ (K, N) as multiply + sum, so inductor writes the matrix-vector product
    itself (16-bit weights widened to fp32 in registers as they are read: a bf16 sum of 768 terms would
    keep only ~3 significant digits). Anything else (more rows, alpha/beta, other dtypes) keeps aten's
    kernel (NotImplemented)."""
    if beta == alpha == 1 and bias.dim() == 1 and bias.dtype == mat1.dtype and float_gemv.takes(mat1, mat2):
        return torch.ops.mt_float.gemv(mat1, mat2.t(), bias)  # (M, K) x (N, K) weight -> (M, N)
    if mat1.shape[0] != 1 or beta != 1 or alpha != 1 or mat1.dtype not in FLOAT_DTYPES:
        return NotImplemented
    wide = torch.float64 if mat1.dtype == torch.float64 else torch.float32
    return (_one_row_sum(mat1, mat2, wide) + bias.to(wide)).to(mat1.dtype)  # rounded once, as aten's addmm


def _one_row_mm(mat1, mat2):
    if float_gemv.takes(mat1, mat2):
        return torch.ops.mt_float.gemv(mat1, mat2.t())
    if mat1.shape[0] != 1 or mat1.dtype not in FLOAT_DTYPES:
        return NotImplemented
    wide = torch.float64 if mat1.dtype == torch.float64 else torch.float32
    return _one_row_sum(mat1, mat2, wide).to(mat1.dtype)


def _one_row_sum(mat1, mat2, wide: torch.dtype):
    return (mat1[:, :, None].to(wide) * mat2[None].to(wide)).sum(dim=1)  # (1, K, N) -> (1, N), summed in `wide`


def _one_query_attention(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """aten's CPU flash attention for ONE query row (B, H, 1, D), written as reductions inductor fuses:
    scores = sum_d q k, softmax over the keys, out = sum_t p v. Returns (out, logsumexp) as the op does.
    The flash kernel tiles for many queries; with one it streams K and V at a fraction of the bandwidth.
    On the CPU attention/one_query_cpu.py's C++ kernel takes it where it builds (`_one_query_kernel_takes`: the online
    softmax of the paged decode kernel, and it skips the masked, not yet written slots of the static slab,
    which these reductions read all of; docs/08b §4); this decomposition is its reference."""
    B, H, L, D = query.shape
    if L != 1 or dropout_p != 0.0 or is_causal or query.dtype not in FLOAT_DTYPES:
        return NotImplemented
    scale = D ** -0.5 if scale is None else scale
    if _one_query_kernel_takes(query, key, value, attn_mask):
        return one_query_cpu.one_query_kernel(query, key, value, attn_mask, scale)
    dtype = query.dtype
    if dtype in (torch.bfloat16, torch.float16):  # scores, softmax and the sum over keys in fp32
        query, key, value = query.float(), key.float(), value.float()
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.float()
    Hkv, Tk = key.shape[1], key.shape[2]
    q = query.reshape(B, Hkv, H // Hkv, 1, D)  # (B, Hkv, G, 1, D): head h reads kv head h // G, as sdpa's GQA
    scores = (q * key[:, :, None]).sum(dim=-1) * scale  # (B, Hkv, G, Tk)
    scores = scores.reshape(B, H, 1, Tk)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, 1)
    p = torch.exp(scores - lse[..., None]).reshape(B, Hkv, H // Hkv, Tk, 1)  # (B, Hkv, G, Tk, 1)
    out = (p * value[:, :, None]).sum(dim=-2)  # (B, Hkv, G, D)
    return out.reshape(B, H, 1, D).to(dtype), lse


def _one_query_kernel_takes(query, key, value, attn_mask) -> bool:
    """Whether attention/one_query_cpu.py's C++ kernel computes this call: CPU, fp32/bf16/fp16, a mask shared
    by the heads, and the kernel built; fp32 only where its matmuls go to the C++ GEMV too (float64 never:
    it is the reference). Why that condition: with fp32 matmuls written as reductions inductor fuses the
    whole step, attention included, into one C++ function, and an extern attention op would split it at
    every layer, which costs more than the kernel saves; once the GEMV op splits the graph anyway, the
    kernel pays (docs/08b §4)."""
    B, Tk = query.shape[0], key.shape[2]
    shared_mask = attn_mask is None or (attn_mask.dim() == 4 and attn_mask.shape[0] in (1, B)
                                        and attn_mask.shape[1:] == (1, 1, Tk))
    kernel_dtype = query.dtype in (torch.bfloat16, torch.float16) or (
        query.dtype == torch.float32 and float_gemv.kernel_available(torch.float32))
    return (query.device.type == "cpu" and kernel_dtype and shared_mask
            and key.dtype == value.dtype == query.dtype and one_query_cpu.kernel_available())


def cpu_decode_backend(gm, example_inputs):
    """inductor with `decode_decompositions` (the module docstring says what they do and why; docs/08a §2
    has the measurements).

    Caches across processes: inductor's FX-graph cache is ON. Its key hashes the graph inductor gets,
    which is the graph AFTER our decompositions (one-row mm already a multiply-and-sum), the config
    patches below and the decomposition table, pickled by name (`DecodeDecompositions`), so a
    default-inductor graph of the same step has another key. AOTAutograd's cache stays off: its key
    hashes the graph BEFORE decomposition, so it could hand back a default-inductor artifact for our step.

    With int8 weights (quantize.py) the graph also gets a low `realize_cpu_opcount_threshold`: by default
    inductor inlines a reduction's producer (the LayerNorm before a linear) and recomputes it for every
    weight element; with one byte per weight that recomputation, not memory, bounds the loop, so each
    linear's input is stored once. fp32 and int4's packed weights run faster inlined and keep it.

    The generated wrapper's size and stride asserts are left out: they recheck, in Python, before
    and after every kernel, what dynamo's guards checked once, and GraphReplay hands the graph the very tensors
    dynamo saw."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    options = {"fx_graph_cache": True, "size_asserts": False}
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.int8 for t in example_inputs):
        options["realize_cpu_opcount_threshold"] = 4  # int8 weights: store each linear's input once
    with functorch_config.patch(enable_autograd_cache=False):
        graph = compile_fx(gm, example_inputs, config_patches=options, decompositions=decode_decompositions())
    return _recordable(graph)


class DecodeDecompositions(dict):
    """inductor's decomposition table plus the three one-row rules, pickled as a call of
    `decode_decompositions` (by name).

    Relies on (tested with torch 2.15.0): `compile_fx(decompositions=...)` puts the table, pickled, into
    the FX-graph cache key. Pickled as a plain dict it fails (inductor's own table holds objects pickle
    refuses), and every compile would bypass the cache; by name it gives one key in every process."""

    def __reduce__(self):
        return decode_decompositions, ()


def decode_decompositions() -> DecodeDecompositions:
    """inductor's decomposition table plus the three one-row rules above."""
    from torch._inductor.decomposition import select_decomp_table

    aten = torch.ops.aten
    return DecodeDecompositions({**select_decomp_table(), aten.addmm.default: _one_row_addmm,
                                 aten.mm.default: _one_row_mm,
                                 aten._scaled_dot_product_flash_attention_for_cpu.default: _one_query_attention})


class _Recording(threading.local):
    calls: list | None = None  # while a list: each call of a compiled graph appends (graph, inputs, outputs)


_RECORDING = _Recording()


def _recordable(graph: Callable) -> Callable:
    """The compiled graph, with a way for GraphReplay to see the flat inputs dynamo hands it."""
    def call(*inputs):
        outputs = graph(*inputs)
        if _RECORDING.calls is not None:
            _RECORDING.calls.append((graph, inputs, outputs))
        return outputs
    return call


class GraphReplay:
    """The compiled decode step of ONE (model, cache), called without dynamo from the second step on.

    Every call of a dynamo-compiled function gathers the model's weight and cache tensors and checks its
    guards on all of them before it runs the graph: a fixed host cost per token, large beside a quantized
    step (docs/08a). Within one decode the inputs are the same tensors every step but the token, so the
    first step goes through dynamo (every guard checked) while this backend records the flat inputs it
    hands the graph; later steps call the graph with that list, the new token in its slot. Where nothing
    usable was recorded (CUDA graphs, a graph that does not take the token as one input) every step goes
    through dynamo.

    Relies on (tested with torch 2.15.0): dynamo calling the backend's compiled function with the graph's
    flat inputs, the token among them as the very tensor passed in, and the logits among its outputs."""

    def __init__(self, step: Callable, model, token: torch.Tensor, cache):
        self.step, self.model, self.cache, self.graph = step, model, cache, None
        _RECORDING.calls = []
        try:
            self.first_logits = step(model, token, cache)  # (B, V), through dynamo with its guards
            calls = _RECORDING.calls
        finally:
            _RECORDING.calls = None
        if len(calls) != 1:
            return
        graph, inputs, outputs = calls[0]
        token_at = [i for i, t in enumerate(inputs) if t is token]
        logits_at = [i for i, t in enumerate(outputs) if t is self.first_logits]
        if len(token_at) == 1 and len(logits_at) == 1:
            self.graph, self.inputs, self.token_at, self.logits_at = graph, list(inputs), token_at[0], logits_at[0]

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            return self.step(self.model, token, self.cache)
        self.inputs[self.token_at] = token  # (B,) int64 like the first token
        return self.graph(*self.inputs)[self.logits_at]
