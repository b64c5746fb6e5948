"""Pipeline parallelism for training, on torch.distributed.pipelining: the model cut into stages by layers.

    trainer = PipelineTrainer(model, schedule="1f1b", microbatches=4)   # every rank, after init_process_group
    optimizer = make_optimizer(trainer.local, cfg)                       # this rank's stages only
    loss = trainer.step(x, y)          # (B, T) ids and targets, the same global batch on every rank
    trainer.clip_grad_norm_(1.0); optimizer.step(); optimizer.zero_grad()

A stage is a run of consecutive blocks; the first stage also holds the embeddings, the last the final
norm and the head. `StageModule` is a view of the ONE TransformerLM: it holds the model's own modules
(no copy of their code, no copy of their weights) and calls the model's own `embed` and `run_blocks`.
With p ranks, "gpipe" and "1f1b" give each rank one stage; "interleaved-1f1b" gives each rank two,
looped (rank r holds stages r and r + p), as in Megatron's interleaved schedule.

The schedule (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B) splits the batch into microbatches,
runs each stage's forward and backward in its order, and passes activations forward and their gradients
backward with point-to-point send/recv. It divides the summed gradients by the number of microbatches,
so a step equals one process's step on the whole batch (every microbatch the same size).

A tied head (GPT-2: lm_head.weight IS tok_emb.weight) lives on two ranks: the first stage uses the matrix
as the embedding, the last as the head. Each copy gets only its own use's gradient, so after the
schedule the two ranks add their gradients with one all_reduce; with equal gradients (and equal AdamW
state) the two copies stay equal, as Megatron keeps its "embedding group" in sync.

Checkpoints keep the one-process format: `gather_full_state` sends every rank's weights and AdamW state
to rank 0, which fills its whole model and an optimizer state keyed by the one-process parameter index.
Inference (each rank its layers and their KV cache, activations by send/recv) is in pp_inference.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ..config import TransformerConfig
from ..model.cache import NoCache
from ..model.transformer import TransformerLM, lm_loss

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2}  # interleaved: v = 2 virtual stages per rank
NEEDS_M_AT_LEAST_STAGES = ("1f1b",)  # Schedule1F1B refuses fewer microbatches than stages


def check_pipeline(cfg: TransformerConfig, ranks: int, schedule: str, microbatches: int,
                   batch_size: int | None = None, world_size: int | None = None) -> None:
    """The door: ValueError naming the first bad setting, raised on every rank BEFORE any group is joined,
    so no rank is left waiting for one that stopped. `world_size` is what torchrun started (WORLD_SIZE)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise ValueError(f"pipeline_parallel={ranks!r} must be an integer >= 2 (the number of pipeline ranks)")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not a pipeline schedule; expected one of {sorted(SCHEDULES)}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be a positive integer")
    if world_size is not None and world_size != ranks:
        raise ValueError(f"pipeline_parallel={ranks} needs exactly {ranks} processes, but torchrun started "
                         f"WORLD_SIZE={world_size} (run torchrun --nproc-per-node {ranks})")
    stages = ranks * STAGES_PER_RANK[schedule]
    if stages > cfg.n_layer:
        raise ValueError(f"{stages} pipeline stages ({ranks} ranks x {STAGES_PER_RANK[schedule]} for {schedule}) "
                         f"need at least {stages} layers, the model has n_layer={cfg.n_layer}")
    if schedule in NEEDS_M_AT_LEAST_STAGES and microbatches < ranks:
        raise ValueError(f"schedule={schedule} needs microbatches >= the {ranks} stages (got microbatches="
                         f"{microbatches}): with fewer, no stage ever reaches its one-forward-one-backward phase")
    if batch_size is not None and batch_size % microbatches:
        raise ValueError(f"batch_size={batch_size} must be divisible by microbatches={microbatches} "
                         f"(every microbatch the same size, so the mean of their losses is the batch's loss)")


def bubble_fraction(ranks: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of a step each rank idles, stages taking equal time: (p - 1) / (v M + p - 1).

    GPipe and 1F1B (v = 1): the pipeline fills for p - 1 slots and drains for p - 1, around the M slots
    of real work. Interleaving v stages per rank makes every slot v times shorter, the fill and drain too."""
    return (ranks - 1) / (stages_per_rank * microbatches + ranks - 1)


def split_layers(n_layer: int, n_stages: int) -> list[range]:
    """Consecutive layers per stage, as even as possible (the first stages take the extra ones)."""
    base, extra = divmod(n_layer, n_stages)
    bounds = [0]
    for stage in range(n_stages):
        bounds.append(bounds[-1] + base + (stage < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]


def stages_of_rank(rank: int, ranks: int, schedule: str) -> list[int]:
    """The stage indices rank holds: [rank] or, looped, [rank, rank + ranks, ...] (what the schedules expect)."""
    return [rank + k * ranks for k in range(STAGES_PER_RANK[schedule])]


class StageModule(nn.Module):
    """Stage `index` of `n_stages` of the model: its blocks, plus the embeddings (first) or the final norm
    and head (last). Its parameters are the model's own tensors, so the optimizer built on it updates the
    model. forward: ids (B, T) on the first stage, activations (B, T, C) elsewhere -> activations, or
    logits (B, T, V) on the last stage."""

    def __init__(self, model: TransformerLM, index: int, n_stages: int):
        super().__init__()
        self.index, self.n_stages = index, n_stages
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.layers = split_layers(model.config.n_layer, n_stages)[index]
        self.blocks = nn.ModuleList(model.blocks[i] for i in self.layers)
        if self.is_first:  # registered here so that parameters() lists them for this stage's optimizer
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        if self.is_last:
            self.norm_f, self.lm_head = model.norm_f, model.lm_head  # a tied lm_head.weight is tok_emb.weight
        self._model = [model]  # in a list: the calls below go through the model, its modules are not ours

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self._model[0]
        B, T = x.shape[:2]
        positions = torch.arange(T, device=x.device).expand(B, T)  # (B, T): training has no padding
        if self.is_first:
            x = model.emb_drop(model.embed(x, positions))  # (B, T) ids -> (B, T, C)
        x = model.run_blocks(self.blocks, x, NoCache(), positions)  # (B, T, C)
        if self.is_last:
            x = self.lm_head(self.norm_f(x))  # (B, T, V)
        return x


def full_names(model: TransformerLM) -> dict[torch.Tensor, str]:
    """Each parameter tensor -> its name in the whole model (a tied matrix: its first name, tok_emb.weight)."""
    return {param: name for name, param in model.named_parameters()}


def one_process_order(model: TransformerLM) -> list[str]:
    """Parameter names in the order of make_optimizer's param groups (>= 2-D first, then the rest): the
    index an optimizer state dict of a one-process run gives each parameter."""
    named = list(model.named_parameters())
    return [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]


class PipelineTrainer:
    """This rank's stages, the schedule that runs them, and what a step needs beyond it (the tied head's
    gradient, the global gradient norm, one loss for every rank). Call after init_process_group."""

    def __init__(self, model: TransformerLM, schedule: str, microbatches: int, device=None):
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        check_pipeline(model.config, self.ranks, schedule, microbatches)
        self.model, self.schedule_name, self.microbatches = model, schedule, microbatches
        device = torch.device("cpu") if device is None else torch.device(device)
        n_stages = self.ranks * STAGES_PER_RANK[schedule]
        indices = stages_of_rank(self.rank, self.ranks, schedule)
        self.stage_modules = [StageModule(model, i, n_stages) for i in indices]
        self.local = nn.ModuleList(self.stage_modules)  # what this rank's optimizer sees
        self.stages = [PipelineStage(m, i, n_stages, device) for m, i in zip(self.stage_modules, indices, strict=True)]
        kind = SCHEDULES[schedule]
        self.schedule = kind(self.stages if schedule == "interleaved-1f1b" else self.stages[0], microbatches,
                             loss_fn=lm_loss)
        self.first_rank, self.last_rank = 0, self.ranks - 1  # stage 0 lives on rank 0, the last stage on the last
        self.tied = model.config.tie_weights
        # the tied matrix is on the first and the last rank; their group adds its two gradients
        self.tied_group = None if self.ranks == 2 else dist.new_group([self.first_rank, self.last_rank])
        self.names = full_names(model)

    @property
    def holds_first(self) -> bool:
        return self.rank == self.first_rank

    @property
    def holds_last(self) -> bool:
        return self.rank == self.last_rank

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the batch x, y (B, T) in microbatches; gradients summed into .grad (and
        divided by the microbatch count). Returns the batch's mean loss, the same 0-d tensor on every rank."""
        losses: list[torch.Tensor] = []
        if self.holds_first:
            self.schedule.step(x, target=y if self.holds_last else None, losses=losses)
        elif self.holds_last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        loss = torch.stack(losses).mean().detach() if self.holds_last else torch.zeros((), device=x.device)
        dist.broadcast(loss, src=self.last_rank)  # every rank sees the loss: all stop together if it is NaN
        if self.tied and (self.holds_first or self.holds_last):
            grad = self.model.tok_emb.weight.grad  # embedding use on the first rank, head use on the last
            dist.all_reduce(grad, group=self.tied_group)
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every rank's gradients so the norm over the WHOLE model is at most max_norm, as
        torch.nn.utils.clip_grad_norm_ does in one process. The tied matrix is counted once (first rank)."""
        grads = [p.grad for p in self.local.parameters() if p.grad is not None]
        if self.tied and self.holds_last and not self.holds_first:
            grads = [g for g in grads if g is not self.model.tok_emb.weight.grad]
        squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        dist.all_reduce(squares)  # sum over ranks of the squared norms of their parameters
        total = squares.sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # the same formula as clip_grad_norm_
        for grad in (p.grad for p in self.local.parameters() if p.grad is not None):
            grad.mul_(scale.to(grad.dtype))
        return total

    # ------------------------------------------------------------------ checkpoints (one-process format)
    def gather_full_state(self, optimizer) -> tuple[TransformerLM | None, dict | None]:
        """(the whole model, an optimizer state dict keyed like a one-process run's) on rank 0; (None, None)
        elsewhere. Rank 0 copies the other ranks' weights into its model in place. A collective."""
        weights = {self.names[p]: p.detach().cpu() for p in self.local.parameters()}
        state = optimizer.state_dict()
        local_order = [p for group in optimizer.param_groups for p in group["params"]]
        by_name = {self.names[local_order[i]]: values for i, values in state["state"].items()}
        gathered = [None] * self.ranks if self.rank == 0 else None
        dist.gather_object((weights, by_name), gathered, dst=0)
        if self.rank != 0:
            return None, None
        params = dict(self.model.named_parameters())
        all_state: dict[str, dict] = {}
        with torch.no_grad():
            for rank_weights, rank_state in gathered:
                for name, tensor in rank_weights.items():
                    params[name].copy_(tensor)
                all_state.update(rank_state)
        order = one_process_order(self.model)
        index = {name: i for i, name in enumerate(order)}
        n_matrices = sum(params[n].dim() >= 2 for n in order)
        groups = [{**g, "params": []} for g in state["param_groups"]]
        groups[0]["params"], groups[1]["params"] = list(range(n_matrices)), list(range(n_matrices, len(order)))
        return self.model, {"state": {index[n]: v for n, v in all_state.items()}, "param_groups": groups}

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        """Load a one-process optimizer state (keyed by one-process index): each rank keeps its parameters'."""
        order = one_process_order(self.model)
        local_order = [p for group in optimizer.param_groups for p in group["params"]]
        local_index = {self.names[p]: i for i, p in enumerate(local_order)}
        if len(order) != sum(len(g["params"]) for g in state["param_groups"]):
            raise ValueError(f"the saved optimizer state has {sum(len(g['params']) for g in state['param_groups'])} "
                             f"parameters, the model {len(order)}")
        local_state = {local_index[order[i]]: values for i, values in state["state"].items()
                       if order[i] in local_index}
        groups, start = [], 0
        for saved, group in zip(state["param_groups"], optimizer.param_groups, strict=True):
            groups.append({**saved, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        optimizer.load_state_dict({"state": local_state, "param_groups": groups})
