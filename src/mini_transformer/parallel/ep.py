"""Expert parallelism for MoE inference: each rank keeps n_experts / W experts, tokens travel by all_to_all.

    dist.init_process_group("gloo")
    model = TransformerLM(cfg)               # ffn="moe"; the same weights on every rank
    shard_expert_parallel(model)             # each MoE layer keeps experts [rank*E/W, (rank+1)*E/W)
    logits = model(my_rows)[0]               # each rank runs ITS OWN rows of the batch

Everything but the experts (attention, norms, router, shared expert, embeddings) is replicated, and
each rank runs its own slice of the batch through it, as in data parallelism. At an MoE layer the
router picks k experts per token as usual; the (token, expert) rows, already sorted by expert, then go
to the rank that holds that expert:

    1. all_to_all of the row counts  (W x E/W integers: how many rows each rank sends to each expert)
    2. all_to_all of the rows        (dispatch: each row's C values travel to its expert's rank)
    3. the local experts run on what arrived, grouped by expert (one grouped matmul, as in one process)
    4. all_to_all back               (combine: the outputs return to the rank the token lives on)

With uniform routing a share (W-1)/W of the k rows of each token leaves its rank, so an MoE layer sends
2 k (W-1)/W * N * C * bytes per rank (N = the rank's tokens): `model.collectives` counts what was
really sent. Every rank must run the same number of forward passes (the all_to_alls pair up), so
generate without an EOS stop, or keep stepping until every rank is done.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..model.moe import Experts, moe_layers
from ..model.transformer import TransformerLM
from .tp import CollectiveCounter


class ExpertParallelExperts(nn.Module):
    """Takes the place of `MoE.experts`: the same call (rows sorted by global expert, counts (E,), the
    expert of each row) and the same answer, computed by whichever rank holds each expert."""

    def __init__(self, local: Experts, n_experts: int, rank: int, world_size: int, group, counter):
        super().__init__()
        self.local = local  # this rank's E/W experts, renumbered 0 .. E/W-1
        self.n_experts, self.rank, self.world_size = n_experts, rank, world_size  # n_experts: global, for dispatch
        self.group, self.counter = group, counter

    def forward(self, x: torch.Tensor, counts: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        W, per_rank = self.world_size, self.n_experts // self.world_size
        send_counts = counts.view(W, per_rank)  # (W, E/W): rows for rank r's expert e (x is sorted so)
        recv_counts = torch.empty_like(send_counts)  # (W, E/W): rows rank s sends to my expert e
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        # all_to_all needs the split sizes on the host: the one device->host read of an EP layer
        send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        arrived = x.new_empty(sum(recv_splits), x.shape[1])  # (R_in, C), grouped by source rank
        self._all_to_all(arrived, x.contiguous(), recv_splits, send_splits)
        # within each source the rows are sorted by expert; regroup all of them by local expert
        local_expert = torch.arange(per_rank, device=x.device).repeat(W).repeat_interleave(recv_counts.reshape(-1))
        order = torch.argsort(local_expert, stable=True)  # (R_in,)
        out_sorted = self.local(arrived[order], recv_counts.sum(0), local_expert[order])  # (R_in, C)
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted  # back to the order the rows arrived in
        returned = x.new_empty(x.shape[0], out.shape[1])  # (R, C) in x's order
        self._all_to_all(returned, out, send_splits, recv_splits)
        return returned

    def _all_to_all(self, output, tensor, output_splits, input_splits) -> None:
        stay = input_splits[self.rank]  # rows addressed to this rank never leave it
        self.counter.calls += 1
        self.counter.nbytes += (tensor.shape[0] - stay) * tensor.shape[1] * tensor.element_size()
        dist.all_to_all_single(output, tensor, output_splits, input_splits, group=self.group)


def _keep_experts(experts: Experts, start: int, stop: int) -> None:
    """Cut every 3-D expert weight (E, out, in) and bias (E, out) down to experts [start, stop), in place."""
    for module in experts.modules():
        if module is experts or not hasattr(module, "weight"):
            continue
        module.weight = nn.Parameter(module.weight.data[start:stop].clone(), requires_grad=False)
        if getattr(module, "bias", None) is not None:
            module.bias = nn.Parameter(module.bias.data[start:stop].clone(), requires_grad=False)
    experts.n_experts = stop - start


def check_experts_divisible(n_experts: int, world_size: int) -> None:
    if n_experts % world_size != 0:
        raise ValueError(
            f"expert parallelism over world_size={world_size} needs n_experts={n_experts} divisible by it "
            f"(each rank keeps n_experts / world_size experts)"
        )


def shard_expert_parallel(model: TransformerLM, group=None) -> TransformerLM:
    """Keep this rank's experts in every MoE layer of `model` (in place; inference only); returns it."""
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    if model.config.ffn != "moe":
        raise ValueError(f"expert parallelism needs an MoE model (ffn='moe'), got ffn={model.config.ffn!r}")
    if not dist.is_initialized():
        raise ValueError("shard_expert_parallel needs torch.distributed initialised (run under torchrun)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    E = model.config.n_experts
    check_experts_divisible(E, world)  # before any collective: every rank raises, none waits
    counter = CollectiveCounter()
    per_rank = E // world
    for moe in moe_layers(model):
        _keep_experts(moe.experts, rank * per_rank, (rank + 1) * per_rank)
        moe.experts = ExpertParallelExperts(moe.experts, E, rank, world, group, counter)
    model.collectives = counter
    return model.eval()
