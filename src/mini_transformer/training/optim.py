"""One optimisation step, the parts every way of training shares (one process, DDP, FSDP, pipeline):

    lr_at(step, cfg)                 linear warmup, then cosine decay to min_lr
    make_optimizer(model, cfg)       AdamW, weight decay on matrices and embeddings only
    forward_backward(...)            grad_accum_steps micro-batches under autocast, gradients summed
    apply_update(...)                clip the global norm, step, clear the gradients
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from .config import TrainConfig

__all__ = ["apply_update", "forward_backward", "lr_at", "make_optimizer"]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to `lr` over warmup_steps, then cosine decay to `min_lr` at decay_steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / (cfg.warmup + 1)
    if step >= cfg.decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup) / (cfg.decay_steps - cfg.warmup)  # 0 -> 1
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings (>= 2-D), none on biases and norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]  # a tied matrix appears once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=cfg.fused_optimizer or None)


def forward_backward(model, next_batch, cfg: TrainConfig, amp, scaler, world_size: int) -> float:
    """Gradients of grad_accum_steps micro-batches, summed into .grad; -> their mean loss (over ranks too)."""
    loss_sum = 0.0
    for micro in range(cfg.grad_accum_steps):
        x, y = next_batch()
        last_micro = micro == cfg.grad_accum_steps - 1
        sync = model.no_sync() if world_size > 1 and not last_micro and hasattr(model, "no_sync") else None
        with sync or contextlib.nullcontext():  # DDP averages gradients only on the last micro-batch (FSDP: each)
            with amp():
                _, loss = model(x, y)
            loss = loss / cfg.grad_accum_steps  # the update uses the MEAN over all micro-batches
            scaler.scale(loss).backward()
        loss_sum = loss_sum + loss.detach()
    if world_size > 1:  # the mean loss over ranks: the same number everywhere, so all ranks stop together
        dist.all_reduce(loss_sum)
        loss_sum = loss_sum / world_size
    return loss_sum.item()


def apply_update(model, optimizer, scaler, grad_clip: float, pipeline=None) -> None:
    """Clip the global gradient norm, take the AdamW step, clear the gradients."""
    if grad_clip > 0 and pipeline is not None:  # the norm over every rank's stages
        pipeline.clip_grad_norm_(grad_clip)
    elif grad_clip > 0:
        scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
