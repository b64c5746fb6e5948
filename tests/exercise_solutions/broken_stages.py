"""Wrong answers for the exercises of docs/07, 08 and 10 (tests/test_exercises.py adds them to
broken.BROKEN). Each is a whole answer with ONE mistake from its page's "break it" list, written out
here rather than built from the project's code, so that these checks run even where a stage's code has
not landed yet."""

from __future__ import annotations

import json
import math
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------- ex07_sse_client (docs/07)
def _sse_event(payload):
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _parse_sse(body, require_done=True):
    chunks = []
    for event in body.split("\n\n"):
        data = [line[len("data: "):] for line in event.split("\n") if line.startswith("data: ")]
        if data == ["[DONE]"]:
            return chunks
        chunks += [json.loads(d) for d in data]
    if require_done:
        raise ValueError("no [DONE]")
    return chunks


def _latency_metrics(sent_at, times, tokens, tpot_per="token"):
    if not times:
        raise ValueError("no chunk with text")
    itls = [b - a for a, b in zip(times, times[1:], strict=False)]
    ttft, e2e = times[0] - sent_at, times[-1] - sent_at
    if tpot_per == "chunk":  # the mean ITL: a chunk of several tokens counted as one
        tpot = sum(itls) / len(itls) if itls else None
    else:
        tpot = (e2e - ttft) / (tokens - 1) if tokens > 1 else None
    return {"ttft": ttft, "itls": itls, "e2e": e2e, "tpot": tpot}


def _ex11(sse=_sse_event, parse=_parse_sse, latency=_latency_metrics):
    return types.SimpleNamespace(sse_event=sse, parse_sse=parse, latency_metrics=latency)


# ---------------------------------------------------------------------------- ex08_int8_speculative (docs/08b, 08c)
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


def _ex12(quantize=_quantize_int8, accept=_accept_drafts):
    return types.SimpleNamespace(quantize_int8=quantize, dequantize_int8=_dequantize_int8, accept_drafts=accept)


# --------------------------------------------------------------------------- ex08_roofline (docs/08a)
@dataclass(frozen=True)
class _Model:
    vocab_size: int
    d_model: int
    n_layer: int
    n_heads: int
    n_kv_heads: int
    d_ff: int

    @property
    def d_head(self):
        return self.d_model // self.n_heads


def _ex08_roofline(whole_embedding=False, kv_factor=2, ridge_from_weights=False):
    def linear_params(m):
        qkvo = m.d_model * m.d_head * (2 * m.n_heads + 2 * m.n_kv_heads)
        return m.n_layer * (qkvo + 3 * m.d_model * m.d_ff) + m.d_model * m.vocab_size

    def weight_bytes(m, b):
        embedding = m.vocab_size * m.d_model if whole_embedding else m.d_model
        return (linear_params(m) + (2 * m.n_layer + 1) * m.d_model + embedding) * b

    def kv_bytes_per_token(m, b):
        return kv_factor * m.n_layer * m.n_kv_heads * m.d_head * b

    def step_flops(m, batch, context):
        return batch * (2 * linear_params(m) + 4 * m.n_layer * m.n_heads * m.d_head * (context + 1))

    def step_bytes(m, batch, context, b):
        return weight_bytes(m, b) + batch * (context + 1) * kv_bytes_per_token(m, b)

    def ridge_batch(m, context, b, peak_flops, bandwidth):
        ridge = peak_flops / bandwidth
        if ridge_from_weights:  # batch · 2 · params / weight bytes >= ridge, the K/V left out
            return math.ceil(ridge * weight_bytes(m, b) / (2 * linear_params(m)))
        if step_flops(m, 1, context) / ((context + 1) * kv_bytes_per_token(m, b)) <= ridge:
            return None
        batch = 1
        while step_flops(m, batch, context) / step_bytes(m, batch, context, b) < ridge:
            batch += 1
        return batch

    return types.SimpleNamespace(
        Model=_Model, linear_params=linear_params, weight_bytes=weight_bytes, kv_bytes_per_token=kv_bytes_per_token,
        step_flops=step_flops, step_bytes=step_bytes, ridge_batch=ridge_batch,
        max_tokens_per_s=lambda m, context, b, bandwidth: bandwidth / step_bytes(m, 1, context, b),
        ridge_point=lambda peak_flops, bandwidth: peak_flops / bandwidth)


# ---------------------------------------------------------------------------- ex10_tensor_parallel (docs/10)
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


def _ex13(mlp=_tp_mlp, qkv=_qkv_rows):
    return types.SimpleNamespace(column_shard=_column_shard, row_shard=_row_shard, tp_mlp=mlp, qkv_shard_rows=qkv)


# ---------------------------------------------------------------------------- ex10_pipeline_schedule (docs/10)
def _gpipe_order(rank, ranks, microbatches):
    return [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]


def _1f1b_order(rank, ranks, microbatches, warmup_by_rank=True):
    warmup = min(ranks - 1 - rank if warmup_by_rank else ranks - 1, microbatches)
    order, backward = [("F", m) for m in range(warmup)], 0
    for forward in range(warmup, microbatches):
        order += [("F", forward), ("B", backward)]
        backward += 1
    return order + [("B", m) for m in range(backward, microbatches)]


def _bubble(ranks, microbatches, stages_per_rank=1, of_work=False):
    if of_work:  # idle time over the work time, not over the whole span
        return (ranks - 1) / (stages_per_rank * microbatches)
    return (ranks - 1) / (stages_per_rank * microbatches + ranks - 1)


def _simulate(orders, t_forward=1.0, t_backward=2.0, wait_for_neighbours=True):
    ranks, end, free, busy = len(orders), {}, [0.0] * len(orders), [0.0] * len(orders)
    pending = [list(order) for order in orders]
    while any(pending):
        progress = False
        for r in range(ranks):
            while pending[r]:
                kind, m = pending[r][0]
                needs = ([(r - 1, "F", m)] if r > 0 else []) if kind == "F" else \
                    [(r, "F", m)] + ([(r + 1, "B", m)] if r < ranks - 1 else [])
                if not wait_for_neighbours:
                    needs = [n for n in needs if n[0] == r]
                if any(n not in end for n in needs):
                    break
                took = t_forward if kind == "F" else t_backward
                end[r, kind, m] = free[r] = max([free[r]] + [end[n] for n in needs]) + took
                busy[r] += took
                pending[r].pop(0)
                progress = True
        if not progress:
            raise ValueError("deadlock")
    span = max(end.values())
    return [1 - b / span for b in busy]


def _in_flight(order):
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def _ex18(one_f=_1f1b_order, bubble=_bubble, simulate=_simulate):
    return types.SimpleNamespace(gpipe_order=_gpipe_order, one_f_one_b_order=one_f, bubble_fraction=bubble,
                                 simulate=simulate, peak_in_flight=_in_flight)


BROKEN_STAGES = {
    "ex07_sse_client": {
        "an event ends with one newline": _ex11(sse=lambda payload: _sse_event(payload)[:-1]),
        "a stream cut off before [DONE] taken as complete": _ex11(parse=lambda body: _parse_sse(body, False)),
        "TPOT per chunk (the mean ITL), not per token": _ex11(
            latency=lambda s, t, n: _latency_metrics(s, t, n, tpot_per="chunk")),
    },
    "ex08_int8_speculative": {
        "one scale for the whole tensor": _ex12(quantize=lambda w: _quantize_int8(w, per_tensor=True)),
        "truncate instead of round": _ex12(quantize=lambda w: _quantize_int8(w, rounding=torch.trunc)),
        "every draft accepted": _ex12(accept=lambda p, q, d, g: _accept_drafts(p, q, d, g, accept_all=True)),
        "resampled from p, not max(p - q, 0)": _ex12(
            accept=lambda p, q, d, g: _accept_drafts(p, q, d, g, resample_from_p=True)),
    },
    "ex08_roofline": {
        "the whole embedding table counted as read": _ex08_roofline(whole_embedding=True),
        "only K counted in the KV cache": _ex08_roofline(kv_factor=1),
        "the ridge batch from the weights alone, the K/V left out": _ex08_roofline(ridge_from_weights=True),
    },
    "ex10_tensor_parallel": {
        "no all_reduce: rank 0's partial taken as the output": _ex13(
            mlp=lambda *a: _tp_mlp(*a, reduce="none")),
        "b2 added on every rank before the sum": _ex13(mlp=lambda *a: _tp_mlp(*a, bias_per_rank=True)),
        "W_qkv cut as one contiguous block of rows": _ex13(qkv=_qkv_rows_one_block),
    },
    "ex10_pipeline_schedule": {
        "1F1B warm-up of p - 1 forwards on every rank": _ex18(one_f=lambda r, p, m: _1f1b_order(r, p, m, False)),
        "bubble over the work, (p - 1) / (v M)": _ex18(bubble=lambda p, m, v=1: _bubble(p, m, v, of_work=True)),
        "a stage that does not wait for its neighbours": _ex18(
            simulate=lambda o, f=1.0, b=2.0: _simulate(o, f, b, wait_for_neighbours=False)),
    },
}
