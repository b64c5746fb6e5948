"""Wrong answers for the exercises of docs/07, 08 and 10 (merged into broken.BROKEN). Each is a whole
answer with ONE mistake from its page's "break it" list, written out here rather than built from the
project's code, so that these checks run even where a stage's code has not landed yet."""

from __future__ import annotations

import json
import types

import torch
import torch.nn.functional as F


# ------------------------------------------------------------------------------ exercise 10 (docs/07)
def _sse_event(payload):
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _sse_event_one_newline(payload):
    return _sse_event(payload)[:-1]


class _Text:
    """A right IncrementalText, with switches for the mistakes."""

    hold_back, decode_all, flush_at_final, per_token = True, True, True, True

    def __init__(self, codec, stop):
        self.codec, self.stop = codec, stop
        self.ids, self.sent, self.out, self.stopped = [], 0, "", False

    def add(self, new_ids, final):
        if self.stopped:
            return ""
        for group in ([t] for t in new_ids) if self.per_token else [new_ids]:
            self.ids.extend(group)
            text = self._decoded(group)
            hits = [text.find(s) for s in self.stop if s in text]
            if hits:
                self.stopped = True
                return self._emit(text, min(hits))
        text = self._decoded([])
        if final and self.flush_at_final:
            return self._emit(text, len(text))
        hold = max((len(s) for s in self.stop), default=1) - 1 if self.hold_back else 0
        end = len(text) - hold - (text.endswith("\ufffd") and self.decode_all)
        return self._emit(text, end)

    def _decoded(self, new_ids):
        if self.decode_all:
            return self.codec.decode(self.ids)
        # each token decoded alone and glued on: a character split across tokens is lost
        self.glued = getattr(self, "glued", "") + self.codec.decode(new_ids)
        return self.glued

    def _emit(self, text, end):
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent, self.out = max(self.sent, end), self.out + piece
        return piece


class _TextNoHoldBack(_Text):
    hold_back = False


class _TextDecodesOnlyTheNewIds(_Text):
    decode_all = False


class _TextLosesTheTail(_Text):
    flush_at_final = False


class _TextStopsLookedForOncePerAdd(_Text):
    per_token = False


def _ex10(sse_event=_sse_event, text=_Text):
    return types.SimpleNamespace(sse_event=sse_event, IncrementalText=text)


# ------------------------------------------------------------------------------ exercise 11 (docs/08)
def _quantize_int8(w, per_tensor=False, rounding=torch.round):
    biggest = w.abs().amax() if per_tensor else w.abs().amax(dim=1)
    scales = (biggest.clamp(min=1e-12) / 127).expand(w.shape[0]).float()  # (N,)
    return rounding(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def _dequantize_int8(q, scales):
    return q.float() * scales[:, None]


def _accept_drafts(p, q, drafts, generator, accept_all=False, resample_from_p=False):
    for i, d in enumerate(drafts):
        if accept_all or float(torch.rand((), generator=generator)) < float(p[i, d] / q[i, d]):
            continue
        residual = p[i].clone() if resample_from_p else (p[i] - q[i]).clamp(min=0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))


def _ex11(quantize=_quantize_int8, accept=_accept_drafts):
    return types.SimpleNamespace(quantize_int8=quantize, dequantize_int8=_dequantize_int8, accept_drafts=accept)


# ------------------------------------------------------------------------------ exercise 12 (docs/10)
def _column_shard(w, b, rank, world):
    rows = slice(rank * w.shape[0] // world, (rank + 1) * w.shape[0] // world)
    return w[rows], None if b is None else b[rows]


def _row_shard(w, rank, world):
    return w[:, rank * w.shape[1] // world:(rank + 1) * w.shape[1] // world]


def _tp_mlp(x, w1, b1, w2, b2, world, reduce="sum", bias_per_rank=False):
    partials = []
    for rank in range(world):
        w1_r, b1_r = _column_shard(w1, b1, rank, world)
        partial = F.gelu(x @ w1_r.T + b1_r) @ _row_shard(w2, rank, world).T  # (T, C)
        partials.append(partial + b2 if bias_per_rank else partial)
    total = partials[0] if reduce == "none" else sum(partials)
    return total if bias_per_rank else total + b2, partials


def _qkv_rows(n_heads, n_kv_heads, d_head, rank, world):
    q = torch.arange(rank * n_heads // world * d_head, (rank + 1) * n_heads // world * d_head)
    kv = torch.arange(rank * n_kv_heads // world * d_head, (rank + 1) * n_kv_heads // world * d_head)
    return torch.cat([q, n_heads * d_head + kv, (n_heads + n_kv_heads) * d_head + kv])


def _qkv_rows_one_block(n_heads, n_kv_heads, d_head, rank, world):
    """The fused rows cut like any column-parallel weight: one contiguous block per rank."""
    per_rank = (n_heads + 2 * n_kv_heads) * d_head // world
    return torch.arange(rank * per_rank, (rank + 1) * per_rank)


def _ex12(mlp=_tp_mlp, qkv=_qkv_rows):
    return types.SimpleNamespace(column_shard=_column_shard, row_shard=_row_shard, tp_mlp=mlp, qkv_shard_rows=qkv)


BROKEN_STAGES = {
    "ex10_sse_stream": {
        "an event ends with one newline": _ex10(sse_event=_sse_event_one_newline),
        "no hold-back: a stop string's start leaks": _ex10(text=_TextNoHoldBack),
        "only the new ids decoded": _ex10(text=_TextDecodesOnlyTheNewIds),
        "the held-back tail never sent": _ex10(text=_TextLosesTheTail),
        "stop strings looked for once per add, not per token": _ex10(text=_TextStopsLookedForOncePerAdd),
    },
    "ex11_int8_speculative": {
        "one scale for the whole tensor": _ex11(quantize=lambda w: _quantize_int8(w, per_tensor=True)),
        "truncate instead of round": _ex11(quantize=lambda w: _quantize_int8(w, rounding=torch.trunc)),
        "every draft accepted": _ex11(accept=lambda p, q, d, g: _accept_drafts(p, q, d, g, accept_all=True)),
        "resampled from p, not max(p - q, 0)": _ex11(
            accept=lambda p, q, d, g: _accept_drafts(p, q, d, g, resample_from_p=True)),
    },
    "ex12_tensor_parallel": {
        "no all_reduce: rank 0's partial taken as the output": _ex12(
            mlp=lambda *a: _tp_mlp(*a, reduce="none")),
        "b2 added on every rank before the sum": _ex12(mlp=lambda *a: _tp_mlp(*a, bias_per_rank=True)),
        "W_qkv cut as one contiguous block of rows": _ex12(qkv=_qkv_rows_one_block),
    },
}
