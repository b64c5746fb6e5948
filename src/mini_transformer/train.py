"""The training loop: AdamW, warmup + cosine, clipping, accumulation, autocast, eval, checkpoints, DDP.

    result = train(TrainConfig(data="pydoc", max_steps=200), TransformerConfig.from_preset("shakespeare-char"))

Run under `torchrun --nproc_per_node=N` the same function trains data-parallel: every rank takes its
slice of each global batch, DDP averages the gradients, and only rank 0 evaluates, prints and writes.
A run directory holds `last/` (written at every eval, used by --resume) and `best/` (lowest val loss),
each a complete checkpoint: model.safetensors, config.json, the tokenizer and train_state.pt.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .config import DictIO, TransformerConfig, _check_choice, _check_positive_int
from .data import get_batch, load_text, split_tokens
from .tokenizer import build_tokenizer
from .train_io import TrainingDiverged, find_checkpoint, finish_run, load_train_state, save_checkpoint
from .transformer import TransformerLM

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
TOKENIZERS = ("char", "bpe")

__all__ = ["TrainConfig", "TrainResult", "TrainingDiverged", "lr_at", "make_optimizer", "train"]


@dataclass
class TrainConfig(DictIO):
    """Everything about HOW to train (the model's shape lives in TransformerConfig).

    Defaults reproduce nanoGPT's CPU "baby" Shakespeare run.
    """

    data: str | None = None  # shakespeare | pydoc | a file path; None = shakespeare, else pydoc
    tokenizer: str = "char"  # char | bpe
    bpe_vocab_size: int = 1024  # only for tokenizer="bpe"
    batch_size: int = 12  # sequences per micro-batch, per rank
    block_size: int | None = None  # tokens per sequence; None = the model's max_seq_len
    grad_accum_steps: int = 1  # micro-batches summed into one update
    max_steps: int = 2000  # optimizer updates
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int | None = None  # None = min(100, a tenth of the decay steps)
    lr_decay_steps: int | None = None  # where the cosine reaches min_lr; None = max_steps
    weight_decay: float = 0.1  # on >= 2-D weights only
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping
    eval_interval: int = 250
    eval_batches: int = 20
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    precision: str = "auto"  # auto (bf16/fp16 autocast on CUDA, fp32 elsewhere) | fp32 | bf16 | fp16
    compile: bool = False
    fused_optimizer: bool = True  # one fused AdamW kernel instead of a loop over tensors
    out_dir: str = "out"
    num_samples: int = 2  # texts sampled at the end
    sample_tokens: int = 300
    progress: bool = True
    fsdp: bool = False  # under torchrun: FSDP2 shards weights, grads and AdamW state (parallel/fsdp.py), not DDP

    def __post_init__(self) -> None:
        _check_choice("tokenizer", self.tokenizer, TOKENIZERS)
        _check_choice("precision", self.precision, PRECISIONS)
        for name in ("bpe_vocab_size", "batch_size", "grad_accum_steps", "max_steps", "eval_interval",
                     "eval_batches", "sample_tokens"):
            _check_positive_int(name, getattr(self, name))
        for name in ("block_size", "lr_decay_steps"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        for name in ("num_samples", "seed", "warmup_steps"):
            value = getattr(self, name)
            if name == "warmup_steps" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative integer")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"{name}={value!r} must be a non-negative finite number")
        if self.lr <= 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 < min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
                raise ValueError(f"{name}={value!r} must be in [0, 1)")
        if self.warmup_steps is not None and self.warmup_steps >= self.decay_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} must be smaller than lr_decay_steps (or max_steps)="
                f"{self.decay_steps}"
            )
        for name in ("compile", "fused_optimizer", "progress", "fsdp"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a bool")
        for name in ("device", "out_dir"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a string")

    @property
    def decay_steps(self) -> int:
        return self.lr_decay_steps if self.lr_decay_steps is not None else self.max_steps

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else min(100, self.decay_steps // 10)


@dataclass
class TrainResult:
    model: TransformerLM
    tokenizer: object
    step: int
    best_val_loss: float
    losses: list[float]  # train loss of every step since step 0 (resumed runs included)
    evals: list[list[float]]  # [step, train loss, val loss] at every eval
    step_times: list[float] = field(default_factory=list)  # seconds per step, this process only
    tokens_per_step: int = 0
    out_dir: str = ""


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device={name!r} is not a device torch knows ({err})") from err


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """None = plain fp32. 'auto' picks bf16 (or fp16 on older GPUs) on CUDA only."""
    if precision == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def _setup_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    """-> (rank, world_size, device). torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; plain runs have none."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(cfg.device)
    if world_size == 1:
        return 0, 1, device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return rank, world_size, device


@torch.no_grad()
def estimate_loss(model, splits: dict, cfg: TrainConfig, block_size: int, device, amp) -> dict[str, float]:
    """Mean loss over the same `eval_batches` windows at every eval (a fixed generator), per split."""
    model.eval()
    out = {}
    for name, data in splits.items():
        generator = torch.Generator().manual_seed(cfg.seed + 1)
        total = 0.0
        for _ in range(cfg.eval_batches):
            x, y = get_batch(data, cfg.batch_size, block_size, generator)
            with amp():
                total += model(x.to(device), y.to(device))[1].item()
        out[name] = total / cfg.eval_batches
    model.train()
    return out


def _prepare(cfg: TrainConfig, model_cfg: TransformerConfig | None, resume: str | None):
    """Text, tokenizer, model and (when resuming) the saved training state."""
    if resume is not None:
        from .checkpoint import load_pretrained
        from .tokenizer import load_tokenizer

        if model_cfg is not None and not isinstance(model_cfg, dict):
            raise TypeError(f"with resume, model_cfg must be a dict of overrides or None, got {type(model_cfg)}")
        ckpt = find_checkpoint(resume)
        state = load_train_state(ckpt)
        if state["step"] >= cfg.max_steps:
            raise ValueError(f"the checkpoint {ckpt} is at step {state['step']}; max_steps={cfg.max_steps} "
                             f"leaves nothing to train (raise max_steps)")
        tokenizer = load_tokenizer(ckpt)
        model = load_pretrained(ckpt, **(model_cfg or {}))
        text, _ = load_text(state["data_name"] if cfg.data is None else cfg.data)
        return text, tokenizer, model, state
    if model_cfg is None:
        model_cfg = TransformerConfig.from_preset("shakespeare-char")
    if not isinstance(model_cfg, TransformerConfig):
        raise TypeError(f"model_cfg must be a TransformerConfig, got {type(model_cfg).__name__}")
    text, data_name = load_text(cfg.data)
    tokenizer = build_tokenizer(cfg.tokenizer, text, cfg.bpe_vocab_size if cfg.tokenizer == "bpe" else None)
    model = TransformerLM(model_cfg.replace(vocab_size=tokenizer.vocab_size))
    return text, tokenizer, model, {"data_name": data_name}


def train(cfg: TrainConfig, model_cfg: TransformerConfig | dict | None = None, *, resume=None) -> TrainResult:
    """Train a model and return it with its loss history. `model_cfg` is a TransformerConfig for a new
    run (vocab_size is taken from the tokenizer) or, with `resume`, a dict of config overrides."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
    if cfg.fsdp and (int(os.environ.get("WORLD_SIZE", "1")) < 2 or cfg.compile):
        raise ValueError("fsdp=True needs torchrun with at least 2 processes (WORLD_SIZE >= 2) and no compile")
    rank, world_size, device = _setup_distributed(cfg)
    try:
        return _train(cfg, model_cfg, resume, rank, world_size, device)
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def _train(cfg, model_cfg, resume, rank, world_size, device) -> TrainResult:
    torch.manual_seed(cfg.seed)  # same init and same dropout stream on every rank (DDP checks nothing)
    text, tokenizer, model, state = _prepare(cfg, model_cfg, resume)
    block_size = cfg.block_size or model.config.max_seq_len
    if block_size > model.config.max_seq_len:
        raise ValueError(f"block_size={block_size} exceeds the model's max_seq_len={model.config.max_seq_len}")
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    train_data, val_data = split_tokens(ids, block_size)
    model.to(device)
    if cfg.fsdp:  # before the optimizer, which must see (and keep state for) the shards only
        from .parallel import fsdp

        fsdp.shard_for_training(model)
    optimizer = make_optimizer(model, cfg)
    amp_dtype = autocast_dtype(cfg.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    generator = torch.Generator().manual_seed(cfg.seed)  # draws every training batch
    step, best_val, losses, evals = 0, math.inf, [], []
    if resume is not None:
        if cfg.fsdp:
            fsdp.load_optimizer_state(model, optimizer, state["optimizer"])
        else:
            optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        generator.set_state(state["batch_rng"])
        torch.set_rng_state(state["torch_rng"])
        if device.type == "cuda" and state["cuda_rng"] is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        step, best_val = state["step"], state["best_val_loss"]
        losses, evals = list(state["losses"]), [list(e) for e in state["evals"]]

    def amp():
        return torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()

    raw_model = model
    if cfg.compile:
        model = torch.compile(model)
    if world_size > 1 and not cfg.fsdp:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    out_dir = Path(cfg.out_dir)
    master = rank == 0
    tokens_per_step = cfg.batch_size * block_size * cfg.grad_accum_steps * world_size

    def checkpoint_state(optimizer_state: dict | None = None) -> dict:
        return {
            "step": step, "best_val_loss": best_val, "losses": losses, "evals": evals,
            "optimizer": optimizer.state_dict() if optimizer_state is None else optimizer_state,
            "scaler": scaler.state_dict(),
            "batch_rng": generator.get_state(), "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "train_config": cfg.to_dict(), "data_name": state["data_name"], "world_size": world_size,
        }

    def evaluate_and_save() -> None:
        nonlocal best_val
        eval_model, optimizer_state = raw_model, None
        if cfg.fsdp:  # every rank sends its shards; rank 0 evaluates and saves a plain model
            eval_model, optimizer_state = fsdp.gather_full_state(raw_model, optimizer)
            if not master:
                return
        result = estimate_loss(eval_model, {"train": train_data, "val": val_data}, cfg, block_size, device, amp)
        evals.append([step, result["train"], result["val"]])
        if cfg.progress:
            bar.write(f"step {step}: train loss {result['train']:.4f}, val loss {result['val']:.4f}")
        if result["val"] < best_val:
            best_val = result["val"]
            save_checkpoint(out_dir / "best", eval_model, tokenizer, checkpoint_state(optimizer_state))
        save_checkpoint(out_dir / "last", eval_model, tokenizer, checkpoint_state(optimizer_state))

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        x, y = get_batch(train_data, cfg.batch_size, block_size, generator, rank=rank, world_size=world_size)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)  # (B, T), (B, T)

    step_times = []
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not (cfg.progress and master), desc="train")
    model.train()
    while step < cfg.max_steps:
        started = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_value = _forward_backward(model, next_batch, cfg, amp, scaler, world_size)
        if not math.isfinite(loss_value):  # checked BEFORE the update: the weights are still good
            bar.close()
            kept = out_dir / "last"
            raise TrainingDiverged(
                f"loss is {loss_value} at step {step + 1} (lr {lr:.3g}); training stopped before updating the "
                f"weights. The last good checkpoint is {kept if kept.exists() else 'not written yet'}; "
                f"try a lower lr, a smaller grad_clip or precision=fp32"
            )
        _update(model, optimizer, scaler, cfg.grad_clip)
        step += 1
        losses.append(loss_value)
        step_times.append(time.perf_counter() - started)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_step / step_times[-1]:.0f}",
                        refresh=False)
        if (master or cfg.fsdp) and (step % cfg.eval_interval == 0 or step == cfg.max_steps):
            evaluate_and_save()
    bar.close()
    if cfg.fsdp:  # a plain model for the samples and the result (rank 0); the others keep their shards
        raw_model = fsdp.gather_full_model(raw_model) or raw_model
    if master:
        finish_run(cfg, raw_model, tokenizer, text, losses, evals, out_dir, device)
    return TrainResult(raw_model, tokenizer, step, best_val, losses, evals, step_times, tokens_per_step, str(out_dir))


def _forward_backward(model, next_batch, cfg: TrainConfig, amp, scaler, world_size: int) -> float:
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


def _update(model, optimizer, scaler, grad_clip: float) -> None:
    """Clip the global gradient norm, take the AdamW step, clear the gradients."""
    if grad_clip > 0:
        scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
