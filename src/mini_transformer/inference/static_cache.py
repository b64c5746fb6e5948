"""A cache whose decode step has the same shapes every time, so `torch.compile` compiles it once.

`KVCache` attends over the slots written so far: `k[:, :, :length]` grows by one slot per token, so a
compiled decode step sees a new shape every step and recompiles (or, past dynamo's limit, falls back to
eager). `StaticCache` answers the same two calls (`begin`, `attend`) as gpt-fast does:

  * the slabs are fixed, one (B, Hkv, max_len, D) tensor per layer;
  * the slot of the next token is a tensor, `input_pos` (1,), never a Python int, so the step never
    reads it back to the host and dynamo never specialises on it;
  * a decode step writes k, v at `input_pos` (`index_copy_`) and attends over ALL max_len slots with a
    key mask derived from positions, `slot <= input_pos`, combined with the prompt's padding mask.

A T > 1 forward (the prompt) is the one exception: our attention puts queries at the END of the keys,
so a prefill over all max_len slots would misalign them. The prompt is therefore prefilled eagerly over
the slots it writes, [0, T), exactly as KVCache does; only the single-token step is compiled.

    cache = StaticCache.for_model(cfg, batch_size=1, max_len=T + n_new)
    logits = model(prompt, cache=cache, check=False)[0][:, -1]       # eager prefill
    step = compiled_decode_step(device)                              # torch.compile(fullgraph=True)
    logits = step(model, next_ids, cache)                            # (B, V), same graph every token
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..attention import one_query_cpu
from ..model import float_gemv
from ..model.cache import Attend
from ..model.transformer import TransformerLM
from .kv_cache import SlabCache


def marks_static_addresses(device: torch.device | str) -> bool:
    """Whether a cache on `device` marks its tensors as never moving (CUDA graphs replay fixed addresses)."""
    return torch.device(device).type == "cuda"


class StaticCache(SlabCache):
    """Fixed (B, Hkv, max_len, D) slabs per layer; one prefill, then single-token steps at `input_pos`."""

    def __init__(self, n_layer: int, batch_size: int, max_len: int, n_kv_heads: int, d_head: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.check_sizes(n_layer=n_layer, batch_size=batch_size, max_len=max_len, n_kv_heads=n_kv_heads,
                         d_head=d_head)
        shape = (batch_size, n_kv_heads, max_len, d_head)
        # One tensor per layer, not one (n_layer, ...) tensor sliced by layer: inductor writes a token in
        # place into a tensor the graph receives, but a write into a VIEW of one (k[layer]) it turned into
        # a copy of the whole slab every step (measured: the step slowed as max_len grew).
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        # True = the slot may hold a real token. Only prompt padding is ever False, so together with
        # `slot <= input_pos` it is the whole key mask of a decode step.
        self.key_padding_mask = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,) position ids
        self.input_pos = torch.zeros(1, dtype=torch.long, device=device)  # slot of the next token
        self.slots = torch.arange(max_len, device=device)  # (max_len,)
        self.prefix_len = 0  # slots [0, prefix_len) written by the eager prefill
        self.prefix_has_padding = False
        if marks_static_addresses(device):  # CUDA graphs replay fixed addresses: say these never move
            for t in (*self.k, *self.v, self.key_padding_mask, self.next_position, self.input_pos, self.slots):
                torch._dynamo.mark_static_address(t)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    def reset(self) -> None:
        """Forget everything (the slabs are kept, in place, so a compiled step keeps its addresses)."""
        self.key_padding_mask.fill_(True)
        self.next_position.zero_()
        self.input_pos.zero_()
        self.prefix_len, self.prefix_has_padding = 0, False

    def begin(self, idx: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        T = idx.shape[1]
        if T > 1:
            return self._begin_prefill(idx, attention_mask)
        # A decode step takes slot input_pos and moves input_pos on (attend writes slot input_pos - 1).
        # Tensor ops only: no host read, and no Python attribute changes (dynamo would guard on them).
        self.input_pos += 1
        positions = self.next_position[:, None].clone()  # (B, 1)
        self.next_position += 1
        return positions

    def _begin_prefill(self, idx, attention_mask) -> torch.Tensor:
        """The prompt (B, T), eager: slots [0, T), positions counted from each row's first real token."""
        assert self.prefix_len == 0, "a StaticCache takes one prefill; reset() it for a new batch"
        T = idx.shape[1]
        self.prefix_len = T
        self.input_pos.fill_(T)
        if attention_mask is None:
            self.next_position.fill_(T)
            return torch.arange(T, device=idx.device).expand(idx.shape[0], T)  # (B, T)
        keep = attention_mask.bool()  # (B, T)
        self.key_padding_mask[:, :T].copy_(keep)
        self.prefix_has_padding = True
        self.next_position.copy_(keep.sum(dim=-1))
        return (keep.cumsum(dim=-1) - 1).clamp(min=0)  # (B, T)

    def attend(self, layer: int, q, k, v, attend: Attend) -> torch.Tensor:
        """Keep this layer's k, v (B, Hkv, T, D); return the attention output (B, H, T, D)."""
        if q.shape[2] > 1:  # the eager prefill: attend over the prompt's own slots only
            T = self.prefix_len
            k_prefix, v_prefix = self.k[layer][:, :, :T], self.v[layer][:, :, :T]  # (B, Hkv, T, D) views
            k_prefix.copy_(k)
            v_prefix.copy_(v)
            mask = self.key_padding_mask[:, :T] if self.prefix_has_padding else None
            return attend(q, k_prefix, v_prefix, mask)
        write_pos = self.input_pos - 1  # (1,) the slot begin() took for this token
        k_all, v_all = self.k[layer], self.v[layer]  # (B, Hkv, max_len, D): the same shape every step
        k_all.index_copy_(2, write_pos, k)
        v_all.index_copy_(2, write_pos, v)
        visible = self.key_padding_mask & (self.slots <= write_pos)  # (B, max_len): written, not padding
        return attend(q, k_all, v_all, visible)


_SHARED_CACHES: dict[tuple, StaticCache] = {}


def decode_cache(model: TransformerLM, batch_size: int, max_len: int, *, dtype: torch.dtype,
                 device: torch.device | str) -> StaticCache:
    """generate(compile=True)'s cache. Where its tensors are marked static (cuda), the step's CUDA graph
    replays their addresses and a new address makes cudagraph trees record the graph again (after 128
    such records in a process they give up CUDA graphs for the step); there, every call of the same shapes
    gets ONE cache, reset in place, as gpt-fast sets its caches up once, and kept for the process's life
    (one per shape: slab lengths are multiples of 128, so few). So two generate(compile=True) calls of one
    shape must not run at the same time on cuda. Elsewhere a fresh cache per call."""
    if not marks_static_addresses(device):
        return StaticCache.for_model(model, batch_size, max_len, dtype=dtype, device=device)
    cfg = model.config
    key = (cfg.n_layer, batch_size, max_len, model.kv_heads, cfg.d_head, dtype, torch.device(device))
    if key in _SHARED_CACHES:
        _SHARED_CACHES[key].reset()
    else:
        _SHARED_CACHES[key] = StaticCache.for_model(model, batch_size, max_len, dtype=dtype, device=device)
    return _SHARED_CACHES[key]


def _decode_one(model, token: torch.Tensor, cache: StaticCache) -> torch.Tensor:
    """One token per row (B,) -> its logits (B, V). The function torch.compile traces."""
    logits, _ = model(token[:, None], cache=cache, check=False)  # (B, 1, V)
    return logits[:, -1]


_COMPILED: dict[str, Callable] = {}


def static_length(needed: int, max_seq_len: int, multiple: int = 128) -> int:
    """The slab length for `needed` slots: rounded up to a multiple of 128 (at most max_seq_len), so that
    generate() calls of nearby lengths share one compiled graph instead of compiling one each. The price:
    a step attends over (masked) slots it does not need yet."""
    return min(max_seq_len, -(-needed // multiple) * multiple)


FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _one_row_addmm(bias, mat1, mat2, beta=1, alpha=1):
    """addmm of a few rows (M <= 8, a decode step's batch) @ an nn.Linear weight: model/float_gemv.py's C++
    GEMV (fp32, bf16, fp16 on a CPU with AVX-512; the weight read front to back once, sums in fp32, rounded
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
    which these reductions read all of: 89 -> 44 us per layer, bf16, docs/08); this decomposition is its reference."""
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
    every layer (measured, 124.7M Llama, 255 steps, taking turns: 0.95-0.99x with the kernel); once the
    GEMV op splits the graph anyway, the kernel pays (fp32 83.9 -> 88.5 tok/s; bf16 1.02-1.26x)."""
    B, Tk = query.shape[0], key.shape[2]
    shared_mask = attn_mask is None or (attn_mask.dim() == 4 and attn_mask.shape[0] in (1, B)
                                        and attn_mask.shape[1:] == (1, 1, Tk))
    kernel_dtype = query.dtype in (torch.bfloat16, torch.float16) or (
        query.dtype == torch.float32 and float_gemv.kernel_available(torch.float32))
    return (query.device.type == "cpu" and kernel_dtype and shared_mask
            and key.dtype == value.dtype == query.dtype and one_query_cpu.kernel_available())


def _cpu_decode_backend(gm, example_inputs):
    """inductor, with one-row matmuls lowered to a fused multiply-and-sum (a GEMV inductor writes in C++).

    Why: at batch 1 every linear layer is a matrix-vector product and reads its weight once. MKL's sgemm
    called with one row reads the weights at about half the speed the core can stream them (measured:
    the 24 weight matrices of the 6x384 model, 42.5 MB, 2.4 ms through `addmm` against 1.0 ms as an
    inductor reduction, single thread); the vectorised reduction inductor generates streams each row of
    W once at near the `sum()` bandwidth. Inductor's own table decomposes mm this way only on GPUs.
    Caches across processes: inductor's FX-graph cache is ON. Its key hashes the graph inductor gets,
    which is the graph AFTER our decompositions (one-row mm already a multiply-and-sum), the config
    patches below and the name of the decomposition function, so a default-inductor graph of the same step
    has another key. AOTAutograd's cache stays off: its key hashes the graph BEFORE decomposition, so it
    could hand back a default-inductor artifact for our step (the reason both were off before).

    With int8 weights (quantize.py) the graph also gets a low `realize_cpu_opcount_threshold`:
    by default inductor inlines a reduction's producer (the LayerNorm before a linear) and recomputes
    it for every weight element; with one byte per weight that recomputation, not memory, bounds the
    loop (measured, GPT-2 small int8 step: 15.8 ms inlined, 6.6 ms with the input stored once). With
    fp32 weights the inlined form is the faster one (6x384 step: 2.9 ms against 4.8 ms), and so it is for
    int4's packed uint8 weights (measured 3.5x slower stored: its unpacking already dominates), so they keep it."""
    from unittest import mock

    from torch._functorch import config as functorch_config
    from torch._inductor import compile_fx as compile_fx_module

    options = {"fx_graph_cache": True}
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.int8 for t in example_inputs):
        options["realize_cpu_opcount_threshold"] = 4  # int8 weights: store each linear's input once
    # The table goes in as compile_fx's `select_decomp_table` for this call, not as `decompositions=`: a
    # dict passed there becomes part of the FX-graph cache key, and inductor's default table holds objects
    # that cannot be pickled for a key (DispatchKey), so every compile bypassed the cache (measured).
    # A module-level function is pickled by name instead.
    with functorch_config.patch(enable_autograd_cache=False), \
            mock.patch.object(compile_fx_module, "select_decomp_table", decode_decompositions):
        return _recordable(compile_fx_module.compile_fx(gm, example_inputs, config_patches=options))


class _Recording(threading.local):
    calls: list | None = None  # while a list: each call of a compiled graph appends (graph, inputs, outputs)


RECORDING = _Recording()


def _recordable(graph: Callable) -> Callable:
    """The compiled graph, with a way to see the flat inputs dynamo hands it (generate.GraphStep)."""
    def call(*inputs):
        outputs = graph(*inputs)
        if RECORDING.calls is not None:
            RECORDING.calls.append((graph, inputs, outputs))
        return outputs
    return call


def decode_decompositions() -> dict:
    """inductor's decomposition table plus the three one-row rules above."""
    from torch._inductor.decomposition import select_decomp_table

    aten = torch.ops.aten
    return {**select_decomp_table(), aten.addmm.default: _one_row_addmm, aten.mm.default: _one_row_mm,
            aten._scaled_dot_product_flash_attention_for_cpu.default: _one_query_attention}


def compiled_decode_step(device: torch.device | str) -> Callable:
    """`_decode_one` compiled with fullgraph=True (a graph break would be an error, not a slowdown).

    On CUDA mode="reduce-overhead" records the step as a CUDA graph and replays it: one launch per token
    instead of one per kernel. The CPU has no CUDA graphs; it gets inductor's fused C++ kernels with
    one-row matmuls written as reductions (`_cpu_decode_backend`). The compiled function is made once
    per device type and shared: dynamo keeps one graph per set of shapes, so every model and cache of the
    same shapes reuses it."""
    kind = torch.device(device).type
    if kind not in _COMPILED:
        if kind == "cuda":
            _COMPILED[kind] = torch.compile(_decode_one, mode="reduce-overhead", fullgraph=True, dynamic=False)
        else:
            _COMPILED[kind] = torch.compile(_decode_one, backend=_cpu_decode_backend, fullgraph=True, dynamic=False)
    return _COMPILED[kind]


def step_without_guards(step: Callable, model, token: torch.Tensor, cache: StaticCache) -> torch.Tensor:
    """The compiled step, skipping dynamo's guard checks (all but those that tell its graphs apart).

    Every call first checks dynamo's guards (each weight and slab's dtype, shape and strides, the modules'
    attributes) and looks the graph up. Inside one generate() call they cannot fail from the second step on: the
    same model and cache objects come back with new values only, and the first step checked them all.
    So generate() runs steps 2, 3, ... this way; only this call is affected (a stream callback or user
    code between steps keeps its guards)."""
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        return step(model, token, cache)
