"""Tensor parallelism for inference: Megatron's split of every block, with the collectives in plain sight.

    dist.init_process_group("gloo")            # or "nccl"; torchrun sets RANK / WORLD_SIZE
    model = TransformerLM.from_pretrained(path)  # every rank loads the whole checkpoint ...
    shard_tensor_parallel(model)                # ... and keeps its own slice, in place
    new_ids = generate(model, idx, 50)          # the same tokens on every rank

Each rank keeps a contiguous group of heads and a slice of the FFN's hidden units:

    attention   W_qkv column-parallel: this rank's q heads, and the k/v heads they read (GQA groups stay whole)
                W_o   row-parallel:    partial outputs of its heads, summed by ONE all_reduce
    FFN         fc1 / w_gate / w_up column-parallel, fc2 / w_down row-parallel: ONE all_reduce
    vocabulary  tok_emb and lm_head vocab-parallel: each rank holds V/W rows; the embedding is an
                all_reduce of the rows a rank owns, the head an all_gather of the logit slices

So a layer costs two all_reduces of (B, T, C) and nothing else; columns need no communication because
each rank's slice of the hidden units is used only by its own slice of the next matrix. The embedding
is split too (not replicated): it is 31% of GPT-2 small's weights, and replicating it would leave each
of two ranks holding two thirds of the model instead of half.

The model stays the one TransformerLM: its Linear layers are cut down in place and the attention modules
get their local head counts. `model.config` stays true: it describes the whole model, whose residual
stream is d_model wide on every rank. The shard's sizes (local heads and FFN width) are kept in
`model.tensor_parallel`; a KV cache asks the model's layers how many K/V heads they hold
(`TransformerLM.kv_heads`), so it is sized for the heads this rank really holds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .._checks import instance, positive_int
from ..config import TransformerConfig
from ..model.transformer import TransformerLM
from .launch import join_command_line_group


@dataclass
class TensorParallelInfo:
    """Where this rank's shard sits; `model.config` stays the whole model's (the residual stream keeps its
    full width d_model on every rank). The shard's own sizes are the config's divided by world_size."""

    rank: int
    world_size: int
    n_heads: int  # this rank's query heads
    n_kv_heads: int  # this rank's key/value heads (what its KV cache holds: TransformerLM.kv_heads)
    d_ff: int  # this rank's slice of the FFN's hidden units
    group: object = None  # the process group (None = the default one)


class CollectiveCounter:
    """Counts the bytes this rank hands to collectives (the tensor sizes, not the wire traffic: a ring
    all_reduce of N bytes sends 2 (W-1)/W * N per rank). Python ints only: no device sync."""

    def __init__(self):
        self.calls = 0
        self.nbytes = 0

    def add(self, t: torch.Tensor) -> None:
        self.calls += 1
        self.nbytes += t.numel() * t.element_size()


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: the input features are split across ranks, so each rank
    computes a partial sum of the full output and one all_reduce adds the partial sums up."""

    def __init__(self, weight: torch.Tensor, bias: nn.Parameter | None, group, counter: CollectiveCounter):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (out, in / W)
        self.bias = bias  # (out,) replicated: added once, after the sum
        self.group, self.counter = group, counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # (B, T, out): this rank's share of the output
        self.counter.add(partial)
        dist.all_reduce(partial, group=self.group)  # the layer's one collective: sum over ranks
        return partial if self.bias is None else partial + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, start + rows) of the embedding table (padded so all ranks hold the
    same count). An id outside this range looks up zeros here; the all_reduce adds the one real row."""

    def __init__(self, weight: nn.Parameter, start: int, group, counter: CollectiveCounter):
        super().__init__()
        self.weight, self.start, self.group, self.counter = weight, start, group, counter

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.start  # (B, T)
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # (B, T, C)
        x = x * mine.unsqueeze(-1).to(x.dtype)  # rows other ranks own contribute zero here
        self.counter.add(x)
        dist.all_reduce(x, group=self.group)
        return x


class VocabParallelHead(nn.Module):
    """logits = all_gather(x @ W_local^T) over the vocabulary, trimmed to the real vocab_size."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, world_size: int, group, counter: CollectiveCounter):
        super().__init__()
        self.weight, self.vocab_size, self.world_size = weight, vocab_size, world_size
        self.group, self.counter = group, counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()  # (B, T, V / W)
        self.counter.add(local)
        slices = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(slices, local, group=self.group)
        return torch.cat(slices, dim=-1)[..., : self.vocab_size]  # (B, T, V)


def check_divisible(cfg: TransformerConfig, world_size: int) -> None:
    """Raise ValueError unless heads, kv heads and the FFN width split evenly over `world_size`."""
    positive_int("world_size", world_size)
    if cfg.ffn == "moe":
        raise ValueError("tensor parallelism splits dense FFNs; an MoE model (ffn='moe') splits its experts "
                         "instead (parallel/ep.py: shard_expert_parallel)")
    for name in ("n_heads", "n_kv_heads", "d_ff"):
        value = getattr(cfg, name)
        if value % world_size != 0:
            raise ValueError(
                f"tensor parallelism over world_size={world_size} needs {name}={value} divisible by it "
                f"(each rank keeps {name} / world_size); run with a world size that divides "
                f"n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads} and d_ff={cfg.d_ff}"
            )


def _rows(weight: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([weight[a:b] for a, b in ranges]).clone()


def _shard_column(linear: nn.Linear, ranges: list[tuple[int, int]]) -> None:
    """Keep only the output features in `ranges` (rows of the weight), in place."""
    linear.weight = nn.Parameter(_rows(linear.weight.data, ranges), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(_rows(linear.bias.data, ranges), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _row_parallel(linear: nn.Linear, start: int, stop: int, group, counter) -> RowParallelLinear:
    """Keep only the input features [start, stop) (columns of the weight)."""
    bias = None if linear.bias is None else nn.Parameter(linear.bias.data, requires_grad=False)
    return RowParallelLinear(linear.weight.data[:, start:stop].clone(), bias, group, counter)


def qkv_row_ranges(n_heads: int, n_kv_heads: int, d_head: int, rank: int, world_size: int) -> list[tuple[int, int]]:
    """The rows of the fused W_qkv ((H + 2 Hkv) * D, C) that `rank` keeps: its q heads, then the k and v heads
    they read. Contiguous groups keep GQA whole: q heads [rank*h, (rank+1)*h) use kv heads [rank*hkv, ...)."""
    H, Hkv, D = n_heads, n_kv_heads, d_head
    h, hkv = H // world_size, Hkv // world_size
    q = (rank * h * D, (rank + 1) * h * D)
    k = (H * D + rank * hkv * D, H * D + (rank + 1) * hkv * D)
    v = ((H + Hkv) * D + rank * hkv * D, (H + Hkv) * D + (rank + 1) * hkv * D)
    return [q, k, v]


def _shard_attention(attn, cfg: TransformerConfig, rank: int, world: int, group, counter) -> None:
    H, Hkv = cfg.n_heads, cfg.n_kv_heads
    q, k, v = qkv_row_ranges(H, Hkv, cfg.d_head, rank, world)
    _shard_column(attn.W_qkv, [q, k, v])  # (h + 2*hkv) * D rows: this rank's q, k, v heads
    attn.W_o = _row_parallel(attn.W_o, *q, group, counter)  # columns = the same q heads' outputs
    attn.n_heads, attn.n_kv_heads = H // world, Hkv // world


def _shard_ffn(ffn, cfg: TransformerConfig, rank: int, world: int, group, counter) -> None:
    width = cfg.d_ff // world
    hidden = (rank * width, (rank + 1) * width)
    if cfg.ffn == "swiglu":
        _shard_column(ffn.w_gate, [hidden])
        _shard_column(ffn.w_up, [hidden])
        ffn.w_down = _row_parallel(ffn.w_down, *hidden, group, counter)
    else:
        _shard_column(ffn.fc1, [hidden])
        ffn.fc2 = _row_parallel(ffn.fc2, *hidden, group, counter)


def _shard_vocab(model: TransformerLM, cfg: TransformerConfig, rank: int, world: int, group, counter) -> None:
    rows = -(-cfg.vocab_size // world)  # ceil: the last rank's slice is padded with zero rows
    start = rank * rows

    def slice_of(weight: torch.Tensor) -> nn.Parameter:
        local = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        real = weight[start : start + rows]
        local[: len(real)] = real
        return nn.Parameter(local, requires_grad=False)  # (V / W, C)

    emb = slice_of(model.tok_emb.weight.data)
    head = emb if cfg.tie_weights else slice_of(model.lm_head.weight.data)  # tied: still one tensor
    model.tok_emb = VocabParallelEmbedding(emb, start, group, counter)
    model.lm_head = VocabParallelHead(head, cfg.vocab_size, world, group, counter)


def shard_tensor_parallel(model: TransformerLM, group=None) -> TransformerLM:
    """Cut `model` (the same full weights on every rank) down to this rank's shard, in place; returns it.

    Call it on every rank of `group` (default: the whole world) after init_process_group. The shard
    answers the same forward calls as the full model (inference only: its weights do not train).
    """
    instance("model", model, TransformerLM)
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("model is already sharded for tensor parallelism")
    if not dist.is_initialized():
        raise ValueError("shard_tensor_parallel needs torch.distributed initialised (run under torchrun)")
    cfg = model.config
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    check_divisible(cfg, world)  # before any collective: every rank raises the same error, none waits
    counter = CollectiveCounter()
    with torch.no_grad():
        for block in model.blocks:
            _shard_attention(block.attn, cfg, rank, world, group, counter)
            _shard_ffn(block.ffn, cfg, rank, world, group, counter)
        _shard_vocab(model, cfg, rank, world, group, counter)
    model.tensor_parallel = TensorParallelInfo(rank, world, cfg.n_heads // world, cfg.n_kv_heads // world,
                                               cfg.d_ff // world, group)
    model.collectives = counter
    return model.eval()


def shard_for_command_line(model: TransformerLM, device: str):
    """`sample --tensor-parallel` under torchrun: join the group, shard `model` in place, and return
    where this rank writes its text (stdout on rank 0, a discarded buffer elsewhere). All ranks compute
    the same logits (an all_reduce and an all_gather leave identical values everywhere), so the same
    seeded generator draws the same tokens on every rank without any extra message."""
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world < 1:
        raise ValueError("--tensor-parallel runs under torchrun (WORLD_SIZE is not set); e.g. "
                         "torchrun --nproc-per-node 2 -m mini_transformer.cli sample --tensor-parallel ...")
    check_divisible(model.config, world)  # before joining any group: every rank stops, none waits
    stream = join_command_line_group(model, device)
    shard_tensor_parallel(model)
    return stream
