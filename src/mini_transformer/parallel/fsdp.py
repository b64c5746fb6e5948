"""FSDP2 for `train --fsdp`: every parameter, its gradient and its AdamW state split over the ranks (ZeRO-3).

    shard_for_training(model)              # in place, before the optimizer is made
    optimizer = make_optimizer(model, cfg)  # AdamW sees only this rank's shards: 1/W of the state
    ...
    plain, optimizer_state = gather_full_state(model, optimizer)   # all ranks call; rank 0 gets them

`fully_shard` is applied to each block and then to the whole model. Forward and backward of a block
all-gather its parameters just before use and free them just after; backward reduce-scatters the
gradients, so each rank ends up holding the MEAN gradient (over ranks, as DDP) of its own shard only.
The embedding, final norm and head (one tied tensor) form the root's group.

Checkpoints are gathered to the format of a single-process run (model.safetensors and an optimizer
state dict keyed by parameter index), so an FSDP run resumes from a single-process checkpoint and
the other way round, and `sample` reads its weights like any other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from ..checkpoint import load_state_into
from ..model.transformer import TransformerLM

FULL_ON_RANK_0 = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it all, others {}


def shard_for_training(model: TransformerLM) -> TransformerLM:
    """Apply FSDP2 to each block, then to the whole model (in place; the class becomes FSDPTransformerLM,
    still a TransformerLM). Every rank must hold the same initial weights: each keeps its dim-0 chunk."""
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    if not dist.is_initialized():
        raise ValueError("FSDP needs torch.distributed initialised: run `train --fsdp` under torchrun")
    for block in model.blocks:
        fully_shard(block)  # one all-gather per block in forward, one reduce-scatter in backward
    fully_shard(model)  # the rest: embeddings, final norm, head
    return model


def gather_full_model(model: TransformerLM) -> TransformerLM | None:
    """A plain (unsharded) copy of the model on rank 0, on the model's device; None on other ranks.
    A collective: every rank must call it."""
    state = get_model_state_dict(model, options=FULL_ON_RANK_0)
    if dist.get_rank() != 0:
        return None
    device = next(iter(model.parameters())).device
    with torch.random.fork_rng(devices=[]):  # the throw-away init must not move rank 0's random stream
        plain = TransformerLM(model.config)
    load_state_into(plain, state)
    return plain.to(device)


def gather_full_state(model: TransformerLM, optimizer) -> tuple[TransformerLM | None, dict | None]:
    """(plain model, optimizer state in the single-process format) on rank 0; (None, None) elsewhere."""
    plain = gather_full_model(model)
    by_name = get_optimizer_state_dict(model, optimizer, options=FULL_ON_RANK_0)
    if plain is None:
        return None, None
    return plain, _state_by_index(by_name)


def load_optimizer_state(model: TransformerLM, optimizer, state: dict) -> None:
    """Load a single-process optimizer state (keyed by parameter index) into the sharded optimizer:
    every rank passes the whole state and keeps its own shard of it."""
    names = {param: name for name, param in model.named_parameters()}
    order = [names[p] for group in optimizer.param_groups for p in group["params"]]  # index -> name
    if len(order) != sum(len(g["params"]) for g in state["param_groups"]):
        raise ValueError(f"the saved optimizer state has {sum(len(g['params']) for g in state['param_groups'])} "
                         f"parameters, the model {len(order)}")
    by_name = {
        "state": {order[index]: values for index, values in state["state"].items()},
        "param_groups": [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _state_by_index(by_name: dict) -> dict:
    """{name: state} -> {index: state}, indices in param-group order: what optimizer.state_dict() gives."""
    index: dict[str, int] = {}
    for group in by_name["param_groups"]:
        for name in group["params"]:
            index[name] = len(index)
    return {
        "state": {index[name]: values for name, values in by_name["state"].items()},
        "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in by_name["param_groups"]],
    }


def local_bytes(tensors) -> int:
    """Bytes this rank really holds for `tensors` (a DTensor counts its local shard only)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def training_memory(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and optimizer state, counted from the tensors held."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": local_bytes(state)}
