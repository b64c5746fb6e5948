"""Pipeline-parallel inference: each rank keeps its stage's layers and only their KV cache.

    dist.init_process_group("gloo")               # torchrun sets RANK / WORLD_SIZE
    model = TransformerLM.from_pretrained(path)     # every rank loads the checkpoint ...
    shard_pipeline_parallel(model)                 # ... and keeps its stage, in place
    new_ids = generate(model, idx, 50)             # the same tokens on every rank

Like tensor parallelism (tp.py), the split is done by swapping modules of the one TransformerLM, so its
forward, `generate` and `generate_long` run unchanged. On rank r of p, for every forward pass:

    rank 0       embed -> its blocks -> SendActivations (B, T, C) to rank 1
    rank r       ReceiveActivations from rank r - 1 -> its blocks -> SendActivations to rank r + 1
    rank p - 1   ReceiveActivations -> its blocks -> final norm -> head -> logits broadcast to every rank

Every rank runs the same generation loop on the same ids, so every rank needs the logits: the last rank
broadcasts them (`ReceiveLogits` on the others), and the same seeded sampling then draws the same token
everywhere without another message. `model.config` becomes the stage's config (n_layer = its blocks),
and each block gets its local layer number, so `KVCache.for_model(model.config, ...)` in `generate`
holds this rank's layers only. On ranks after the first, the embedding of the ids is still looked up
and then replaced by the received activations: one gather per token, the price of a forward pass that
stays the model's own. With one sequence the ranks take turns (rank 0 idles while rank 1 works);
a serving system fills the pipeline with other requests' microbatches.
"""

from __future__ import annotations

import atexit
import io
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import TransformerConfig
from ..model.transformer import TransformerLM
from .pp import split_layers


@dataclass
class PipelineInfo:
    rank: int
    world_size: int
    layers: range  # this rank's layers, in the whole model's numbering
    full_config: TransformerConfig


class ReceiveActivations(nn.Module):
    """Replaces the embedding's dropout on ranks after the first: the stage's input comes from rank src."""

    def __init__(self, src: int):
        super().__init__()
        self.src = src

    def forward(self, embedded: torch.Tensor) -> torch.Tensor:
        x = torch.empty_like(embedded)  # (B, T, C): the shape the previous stage sends
        dist.recv(x, src=self.src)
        return x


class SendActivations(nn.Module):
    """Appended to the blocks of every rank but the last: hands the stage's output to rank dst."""

    def __init__(self, dst: int):
        super().__init__()
        self.dst = dst

    def forward(self, x: torch.Tensor, cache, rope) -> torch.Tensor:
        dist.send(x.contiguous(), dst=self.dst)
        return x


class ReceiveLogits(nn.Module):
    """The head on every rank but the last: the last rank's logits (B, T, V), by broadcast."""

    def __init__(self, vocab_size: int, src: int):
        super().__init__()
        self.vocab_size, self.src = vocab_size, src

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x.new_empty(*x.shape[:-1], self.vocab_size)  # (B, T, V)
        dist.broadcast(logits, src=self.src)
        return logits


class BroadcastLogits(nn.Module):
    """The head on the last rank: computes the logits and sends them to every other rank."""

    def __init__(self, head: nn.Linear, src: int):
        super().__init__()
        self.head, self.src = head, src

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)  # (B, T, V)
        dist.broadcast(logits, src=self.src)
        return logits


def shard_pipeline_parallel(model: TransformerLM) -> TransformerLM:
    """Keep this rank's stage of `model` (in place) and plug in the sends and receives; returns model.
    Needs torch.distributed initialised; rank r of p holds the r-th of p runs of consecutive layers."""
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    if not dist.is_initialized():
        raise ValueError("pipeline parallelism needs torch.distributed initialised: run under torchrun")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model.config
    if world > cfg.n_layer:
        raise ValueError(f"{world} pipeline stages need at least {world} layers, the model has n_layer={cfg.n_layer}")
    layers = split_layers(cfg.n_layer, world)[rank]
    blocks = [model.blocks[i] for i in layers]
    for local, block in enumerate(blocks):
        block.attn.layer_idx = local  # the slot of this rank's KV cache
    last = world - 1
    if rank > 0:
        model.emb_drop = ReceiveActivations(src=rank - 1)
    if rank < last:
        blocks.append(SendActivations(dst=rank + 1))
        model.norm_f, model.lm_head = nn.Identity(), ReceiveLogits(cfg.vocab_size, src=last)
    else:
        model.lm_head = BroadcastLogits(model.lm_head, src=last)
    model.blocks = nn.ModuleList(blocks)
    model.pipeline_parallel = PipelineInfo(rank, world, layers, cfg)
    model.config = cfg.replace(n_layer=len(layers))  # what KVCache.for_model sizes this rank's cache by
    return model


def check_command_line(cfg: TransformerConfig, stages: int) -> None:
    """`sample --pipeline-parallel N`: one-line errors before any group is joined (no rank waits)."""
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world < 1:
        raise ValueError("--pipeline-parallel runs under torchrun (WORLD_SIZE is not set); e.g. "
                         f"torchrun --nproc-per-node {stages} -m mini_transformer.cli sample --pipeline-parallel "
                         f"{stages} ...")
    if world != stages:
        raise ValueError(f"--pipeline-parallel {stages} needs exactly {stages} processes, but torchrun started "
                         f"WORLD_SIZE={world} (run torchrun --nproc-per-node {stages})")
    if stages > cfg.n_layer:
        raise ValueError(f"--pipeline-parallel {stages}: {stages} stages need at least {stages} layers, "
                         f"the model has n_layer={cfg.n_layer}")


def shard_for_command_line(model: TransformerLM, device: str, stages: int):
    """`sample --pipeline-parallel N` under torchrun: check, join the group, keep this rank's stage, and
    return where this rank writes its text (stdout on rank 0, a discarded buffer elsewhere)."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 2:
        raise ValueError(f"--pipeline-parallel {stages!r} must be an integer >= 2 (the number of ranks)")
    check_command_line(model.config, stages)
    backend = "gloo"
    if torch.device(device).type == "cuda":  # one GPU per rank
        backend = "nccl"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        model.to("cuda")
    if not dist.is_initialized():  # (a test's launcher may have joined the group already)
        dist.init_process_group(backend)
        atexit.register(_leave_group)
    shard_pipeline_parallel(model)
    return sys.stdout if dist.get_rank() == 0 else io.StringIO()


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
