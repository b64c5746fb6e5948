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

    decoder = CompiledDecoder(model, batch_size=1, needed_len=T + n_new, device=device)
    logits = decoder.prefill(prompt, None)     # eager, into a StaticCache
    logits = decoder.step(next_ids)            # (B, V), the same compiled graph every token
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..model import huge_pages
from ..model.cache import AttendFn
from ..model.transformer import TransformerLM
from .cpu_decode import GraphReplay, cpu_decode_backend
from .decoders import prefill
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
        # place into a tensor the graph receives, but turns a write into a VIEW of one (k[layer]) into a
        # copy of the whole slab every step, a step that slows as max_len grows.
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

    def attend(self, layer: int, q, k, v, attend: AttendFn) -> torch.Tensor:
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
    return model.logits(token[:, None], cache=cache)[:, -1]  # (B, 1, V) -> (B, V)


_COMPILED: dict[str, Callable] = {}


def static_length(needed: int, max_seq_len: int, multiple: int = 128) -> int:
    """The slab length for `needed` slots: rounded up to a multiple of 128 (at most max_seq_len), so that
    generate() calls of nearby lengths share one compiled graph instead of compiling one each. The price:
    a step attends over (masked) slots it does not need yet."""
    return min(max_seq_len, -(-needed // multiple) * multiple)


def compiled_decode_step(device: torch.device | str) -> Callable:
    """`_decode_one` compiled with fullgraph=True (a graph break would be an error, not a slowdown).

    On CUDA mode="reduce-overhead" records the step as a CUDA graph and replays it: one launch per token
    instead of one per kernel. The CPU has no CUDA graphs; it gets inductor's fused C++ kernels with
    one-row matmuls and one-query attention sent to C++ kernels or written as reductions
    (cpu_decode.py). The compiled function is made once
    per device type and shared: dynamo keeps one graph per set of shapes, so every model and cache of the
    same shapes reuses it."""
    kind = torch.device(device).type
    if kind not in _COMPILED:
        if kind == "cuda":
            _COMPILED[kind] = torch.compile(_decode_one, mode="reduce-overhead", fullgraph=True, dynamic=False)
        else:
            _COMPILED[kind] = torch.compile(_decode_one, backend=cpu_decode_backend, fullgraph=True, dynamic=False)
    return _COMPILED[kind]


class CompiledDecoder:
    """generate(compile=True)'s decoder (decoders.py's interface): an eager prefill into a `StaticCache`
    of at least `needed_len` slots, then `compiled_decode_step` once per token on that cache. On the CPU the
    model's large weights are first moved into 2 MB pages (model/huge_pages.py), once per model."""

    def __init__(self, model: TransformerLM, batch_size: int, needed_len: int, device: torch.device | str):
        self.model = model
        if torch.device(device).type == "cpu":
            huge_pages.place_weights(model)  # every step streams the weights: into 2 MB pages, once per model
        max_len = static_length(needed_len, model.config.max_seq_len)
        self.cache = decode_cache(model, batch_size, max_len, dtype=model.tok_emb.weight.dtype, device=device)
        self.compiled_step = compiled_decode_step(device)
        self.replay: GraphReplay | None = None  # the first step records the compiled graph's inputs

    def prefill(self, idx: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return prefill(self.model, idx, self.cache, attention_mask)  # eager: T > 1 (the module docstring)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        if self.replay is None:
            self.replay = GraphReplay(self.compiled_step, self.model, token, self.cache)
            return self.replay.first_logits
        return self.replay(token)
