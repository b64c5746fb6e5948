"""Where a training run executes: the device, the autocast precision, and the torch.distributed process
group that torchrun asks for (joined at the start of `train`, left at its end)."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

from .._checks import string
from .config import TrainConfig

__all__ = ["autocast_dtype", "leave_process_group", "resolve_device", "setup_distributed"]


def resolve_device(name: str) -> torch.device:
    """A torch.device for `name` (auto | cpu | cuda | cuda:N | mps) that this machine really has."""
    string("device", name)
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device={name!r} is not a device name; expected auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} is not available: torch finds no CUDA GPU on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device={name!r} is not available: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={name!r} is not available: torch finds no Apple MPS device on this machine")
    return device


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """None = plain fp32. 'auto' picks bf16 (or fp16 on older GPUs) on CUDA only."""
    if precision == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def setup_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    """-> (rank, world_size, device). torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; plain runs have none."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(cfg.device)
    if world_size == 1:
        return 0, 1, device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # (a test's launcher may have joined the group already)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return rank, world_size, device


def leave_process_group(together: bool) -> None:
    """Leave the process group. After a finished run every rank first frees its DDP wrapper (reference
    cycles keep it, and the gloo group its reducer holds, alive until a gc) and waits for the others:
    a rank that exited while rank 0 was still writing its last checkpoint, its group then freed during
    interpreter shutdown, sometimes aborted in gloo ("terminate called without an active exception").
    After an error there is no barrier: the other ranks may never arrive."""
    if together:
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()
