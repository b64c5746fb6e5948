"""The "break it" experiments of the docs pages, as wrong answers each grader must reject."""

from __future__ import annotations

import math
import types

import torch

from mini_transformer.engine.block_manager import BlockManager as _ProjectBlockManager
from mini_transformer.inference.decoders import decode_step
from mini_transformer.inference.kv_cache import KVCache
from mini_transformer.server.text import IncrementalText as _ProjectIncrementalText

from . import ex02_rope, ex02b_modern_block, ex05_lr_schedule, ex09_moe_router


def _gqa_modulo(q, k, v):
    """Query head h paired with kv head h % Hkv: a valid-looking grouping, but not Llama's."""
    H, Hkv = q.shape[1], k.shape[1]
    index = torch.arange(H) % Hkv
    return torch.softmax(q @ k[:, index].transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v[:, index]


def _swiglu_gate_swapped(x, w_gate, w_up, w_down):
    return (x @ w_gate.T * torch.nn.functional.silu(x @ w_up.T)) @ w_down.T


def _warmup_from_zero(step, lr_max, lr_min, warmup, decay_steps):
    """Step 0 gets lr 0: a wasted first step."""
    if step < warmup:
        return lr_max * step / warmup
    return ex05_lr_schedule.lr_at(step, lr_max, lr_min, warmup, decay_steps)


class _PositionsFromZero(KVCache):
    """Forgets the past when numbering: every pass starts again at position 0."""

    def begin(self, idx, attention_mask):
        super().begin(idx, attention_mask)
        return torch.arange(idx.shape[1]).expand(idx.shape[0], -1)


class _OverwritesTheStart(KVCache):
    """Writes every pass's keys at slot 0 instead of after the old ones."""

    def attend(self, layer, q, k, v, attend):
        T = k.shape[2]
        self.k[layer, :, :, :T] = k
        self.v[layer, :, :, :T] = v
        mask = self.key_padding_mask[:, :T] if self.has_padding else None
        return attend(q, self.k[layer, :, :, :T], self.v[layer, :, :, :T], mask)


class _CountsPadding(KVCache):
    """Numbers padded slots like real tokens."""

    def begin(self, idx, attention_mask):
        start = self.length
        super().begin(idx, attention_mask)
        self.next_position.fill_(self.length)
        return torch.arange(start, self.length).expand(idx.shape[0], -1)


class _FloorBlocks(_ProjectBlockManager):
    """Counts blocks with floor instead of ceil: a partly filled last block is never allocated."""

    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)

    def allocate_slots(self, seq, num_new_tokens):
        needed = (seq.num_computed_tokens + num_new_tokens) // self.block_size - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        seq.block_table += [self._take_free_block() for _ in range(max(needed, 0))]
        return True


class _FreeKeepsBlocks(_FloorBlocks):
    """Allocates right but `free` forgets to give the blocks back to the pool."""

    allocate_slots = _ProjectBlockManager.allocate_slots

    def free(self, seq):
        seq.block_table = []
        seq.num_computed_tokens = 0


def _route_softmax_over_the_k(router_logits, k, renormalize):
    """Top-k of the logits first, softmax over those k only: the weights always sum to 1."""
    top, experts = router_logits.float().topk(k, dim=-1)
    return torch.softmax(top, dim=-1), experts


def _loss_with_soft_shares(router_logits, k):
    """f_e taken from the probabilities instead of the counts: the loss becomes E * sum P_e^2."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    return router_logits.shape[-1] * (probs.mean(0) ** 2).sum()


def _top_p_without_the_crossing_token(logits, top_p):
    """Keeps only tokens whose cumulative probability stays within top_p: the crossing token is lost."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative > top_p
    drop_sorted[..., 0] = False
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def _attention_filling(value):
    def attention(q, k, v, keep=None, causal=True):
        Tq, Tk = q.shape[2], k.shape[2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
        allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)[None, None]
        if keep is not None:
            allowed = allowed & keep[:, None, None, :]
        fill = torch.finfo(scores.dtype).min if value == "finfo.min" else value
        weights = torch.softmax(scores.masked_fill(~allowed, fill), dim=-1)
        return weights @ v

    return attention


def _rope_interleaved_pairs(q, k, positions, theta=10000.0):
    """Pairs (2i, 2i+1) instead of the project's (i, i + D/2): a rotation, but of the wrong pairs."""
    def turn(x):
        D = x.shape[-1]
        angles = positions[:, None].double() * theta ** (-torch.arange(0, D, 2).double() / D)  # (T, D/2)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)

    return turn(q), turn(k)


def _online_softmax_without_alpha(q, k, v, block_k):
    scale = 1.0 / math.sqrt(q.shape[-1])
    m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for j in range(0, k.shape[2], block_k):
        s = q @ k[:, :, j:j + block_k].transpose(-2, -1) * scale
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        l = l + p.sum(-1, keepdim=True)  # the bug: no alpha * l
        acc = acc + p @ v[:, :, j:j + block_k]  # the bug: no alpha * acc
        m = m_new
    return acc / l, (m + torch.log(l)).squeeze(-1)


class _StopCheckedPerChunk(_ProjectIncrementalText):
    """Looks for stop strings once per call, after all its ids: the cut depends on how ids were grouped."""

    def add(self, new_ids, final):
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        text = self.codec.decode(self.ids)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._emit(text, min(hits))
        end = len(text) if final else len(text) - self.hold
        return self._emit(text, end)


class _NoHoldBack(_ProjectIncrementalText):
    """Sends every character at once: the start of a stop string goes out before the stop is seen."""

    def __init__(self, codec, stop):
        super().__init__(codec, stop)
        self.hold = 0


BROKEN = {
    "ex01_attention": {
        "masked scores filled with 0": types.SimpleNamespace(attention=_attention_filling(0.0)),
        "masked scores filled with -inf": types.SimpleNamespace(attention=_attention_filling(float("-inf"))),
        "masked weights not zeroed after softmax": types.SimpleNamespace(attention=_attention_filling("finfo.min")),
    },
    "ex02_rope": {
        "neighbouring pairs (2i, 2i+1)": types.SimpleNamespace(
            rope_tables=ex02_rope.rope_tables, rotate_half=ex02_rope.rotate_half, apply_rope=_rope_interleaved_pairs),
    },
    "ex03_kv_cache": {
        "positions restart at 0 every step": types.SimpleNamespace(KVCache=_PositionsFromZero, decode_step=decode_step),
        "new keys overwrite slot 0": types.SimpleNamespace(KVCache=_OverwritesTheStart, decode_step=decode_step),
        "padding counted in positions": types.SimpleNamespace(KVCache=_CountsPadding, decode_step=decode_step),
    },
    "ex03_top_p": {
        "the token that crosses top_p dropped": types.SimpleNamespace(top_p_filter=_top_p_without_the_crossing_token),
    },
    "ex02b_modern_block": {
        "query head h uses kv head h % Hkv": types.SimpleNamespace(
            rms_norm=ex02b_modern_block.rms_norm, swiglu=ex02b_modern_block.swiglu,
            llama_ffn_size=ex02b_modern_block.llama_ffn_size, gqa_attention=_gqa_modulo),
        "silu on the up branch": types.SimpleNamespace(
            rms_norm=ex02b_modern_block.rms_norm, swiglu=_swiglu_gate_swapped,
            llama_ffn_size=ex02b_modern_block.llama_ffn_size, gqa_attention=ex02b_modern_block.gqa_attention),
    },
    "ex05_lr_schedule": {
        "warmup starts at lr 0": types.SimpleNamespace(lr_at=_warmup_from_zero),
    },
    "ex06_block_manager": {
        "blocks counted with floor, not ceil": types.SimpleNamespace(BlockManager=_FloorBlocks),
        "free loses the blocks": types.SimpleNamespace(BlockManager=_FreeKeepsBlocks),
    },
    "ex09_moe_router": {
        "softmax over the chosen k only": types.SimpleNamespace(
            route=_route_softmax_over_the_k, load_balancing_loss=ex09_moe_router.load_balancing_loss),
        "f from probabilities, not counts": types.SimpleNamespace(
            route=ex09_moe_router.route, load_balancing_loss=_loss_with_soft_shares),
    },
    "ex04_online_softmax": {
        "alpha rescale dropped": types.SimpleNamespace(online_softmax_attention=_online_softmax_without_alpha),
    },
    "ex07_stop_strings": {
        "stop strings checked once per chunk": types.SimpleNamespace(IncrementalText=_StopCheckedPerChunk),
        "no hold-back of a possible stop string": types.SimpleNamespace(IncrementalText=_NoHoldBack),
    },
}
