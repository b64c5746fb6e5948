"""The training loop: eval, checkpoints, resume, DDP / FSDP / pipeline ranks (the step itself: optim.py).

    result = train(TrainConfig(data="pydoc", max_steps=200), TransformerConfig.from_preset("shakespeare-char"))

Run under `torchrun --nproc_per_node=N` the same function trains data-parallel: every rank takes its
slice of each global batch, DDP averages the gradients, and only rank 0 evaluates, prints and writes.
A run directory holds `last/` (written at every eval, used by --resume) and `best/` (lowest val loss),
each a complete checkpoint: model.safetensors, config.json, the tokenizer, train_state.pt and
manifest.json (the sha256 of each file, checked whenever the checkpoint is loaded).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .._checks import boolean, instance
from ..config import TransformerConfig
from ..model.transformer import TransformerLM
from ..tokenizer import build_tokenizer, check_vocab_size, load_tokenizer
from .config import TrainConfig
from .data import get_batch, load_text, split_tokens, text_sha256
from .io import (
    TrainingDiverged,
    check_resumable,
    check_same_data,
    find_checkpoint,
    finish_run,
    load_train_state,
    prepare_out_dir,
    save_checkpoint,
)
from .optim import apply_update, forward_backward, lr_at, make_optimizer
from .runtime import (
    autocast_dtype,
    leave_process_group,
    resolve_device,  # noqa: F401  (callers have long imported it from here)
    setup_distributed,
)

__all__ = ["TrainResult", "train"]


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


@torch.no_grad()
def estimate_loss(model, splits: dict, cfg: TrainConfig, block_size: int, device, amp) -> dict[str, float]:
    """Mean loss over the same `eval_batches` windows at every eval (a fixed generator), per split.
    The losses stay on the device until the split is done: one host read per split, not per batch."""
    model.eval()
    out = {}
    for name, data in splits.items():
        generator = torch.Generator().manual_seed(cfg.seed + 1)
        losses = []
        for _ in range(cfg.eval_batches):
            x, y = get_batch(data, cfg.sequences_per_batch(block_size), block_size, generator)
            with amp():
                losses.append(model(x.to(device), y.to(device))[1].detach().float())
        out[name] = torch.stack(losses).mean().item()
    model.train()
    return out


def _prepare(cfg: TrainConfig, model_cfg: TransformerConfig | None, ckpt: Path | None, allow_data_change: bool):
    """Text, tokenizer, model and (when resuming from the checkpoint `ckpt`) the saved training state."""
    if ckpt is not None:
        if model_cfg is not None and not isinstance(model_cfg, dict):
            raise TypeError(f"with resume, model_cfg must be a dict of overrides or None, got {type(model_cfg)}")
        state = load_train_state(ckpt)
        check_resumable(cfg, state, ckpt)
        tokenizer = load_tokenizer(ckpt)
        model = TransformerLM.from_pretrained(ckpt, **(model_cfg or {}))
        check_vocab_size(tokenizer, model.config.vocab_size, ckpt)
        # the data given, else the saved run's own: data_name is an absolute path (found from any working
        # directory); either way its sha256 must be the one the run recorded
        text, data_name = load_text(state["data_name"] if cfg.data is None else cfg.data)
        check_same_data(state, text_sha256(text), data_name, ckpt, allow_data_change)
        return text, tokenizer, model, {**state, "data_name": data_name}
    if model_cfg is None:
        model_cfg = TransformerConfig.from_preset("shakespeare-char")
    instance("model_cfg", model_cfg, TransformerConfig)
    text, data_name = load_text(cfg.data)
    tokenizer = build_tokenizer(cfg.tokenizer, text, cfg.bpe_vocab_size if cfg.tokenizer == "bpe" else None)
    model = TransformerLM(model_cfg.replace(vocab_size=tokenizer.vocab_size))
    return text, tokenizer, model, {"data_name": data_name}


def train(cfg: TrainConfig, model_cfg: TransformerConfig | dict | None = None, *, resume=None,
          overwrite: bool = False, allow_data_change: bool = False) -> TrainResult:
    """Train a model and return it with its loss history. `model_cfg` is a TransformerConfig for a new
    run (vocab_size is taken from the tokenizer) or, with `resume`, a dict of config overrides.
    A new run refuses an out_dir that already holds one unless `overwrite=True`. A resumed run trains on
    `cfg.data` (None: the run's own data) and refuses a text whose sha256 is not the recorded one unless
    `allow_data_change=True`."""
    instance("cfg", cfg, TrainConfig)
    boolean("allow_data_change", allow_data_change)
    if cfg.fsdp and (int(os.environ.get("WORLD_SIZE", "1")) < 2 or cfg.compile):
        raise ValueError("fsdp=True needs torchrun with at least 2 processes (WORLD_SIZE >= 2) and no compile")
    ckpt = None if resume is None else find_checkpoint(resume)  # verified against its manifest
    if cfg.pipeline_parallel > 1:  # before joining the group: a bad setting stops every rank, none waits
        _check_pipeline_run(cfg, model_cfg, ckpt)
    joined_here = not dist.is_initialized()  # a test's launcher may have joined the group for us
    rank, world_size, device = setup_distributed(cfg)
    finished = False
    try:
        if rank == 0:  # a resumed run may write only into its own directory, unless told to replace another
            other_run = ckpt is None or Path(cfg.out_dir).resolve() != ckpt.parent.resolve()
            prepare_out_dir(cfg.out_dir, fresh=other_run, overwrite=overwrite)
        result = _train(_start(cfg, model_cfg, ckpt, rank, world_size, device, allow_data_change))
        finished = True
        return result
    finally:
        if world_size > 1 and joined_here:
            leave_process_group(together=finished)
        elif world_size > 1 and finished:
            dist.barrier()  # the group stays; the next run starts when every rank has finished this one


def _check_pipeline_run(cfg: TrainConfig, model_cfg, ckpt: Path | None) -> None:
    from ..parallel.pp import check_pipeline

    if ckpt is not None:  # the model's shape comes from the checkpoint's config.json
        from ..checkpoint import CONFIG_NAME, read_json

        saved = {k: v for k, v in read_json(ckpt / CONFIG_NAME).items() if k != "model_type"}
        model_cfg = TransformerConfig.from_dict({**saved, **(model_cfg or {})})
    model_cfg = model_cfg or TransformerConfig.from_preset("shakespeare-char")
    if not isinstance(model_cfg, TransformerConfig):
        return  # _prepare names the wrong type
    check_pipeline(model_cfg, cfg.pipeline_parallel, cfg.schedule, cfg.microbatches, cfg.batch_size,
                   world_size=int(os.environ.get("WORLD_SIZE", "1")))


@dataclass
class _Run:
    """What one training run carries from step to step (on each rank)."""

    cfg: TrainConfig
    model: torch.nn.Module  # what the steps call: maybe compiled, maybe wrapped in DDP
    raw_model: TransformerLM  # what is evaluated and saved
    tokenizer: object
    text: str
    data_name: str
    train_data: torch.Tensor
    val_data: torch.Tensor
    block_size: int
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    generator: torch.Generator  # draws every training batch
    device: torch.device
    amp_dtype: torch.dtype | None
    rank: int
    world_size: int
    pipeline: object = None  # parallel.pp.PipelineTrainer when pipeline_parallel > 1
    step: int = 0
    best_val: float = math.inf
    losses: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    step_times: list = field(default_factory=list)

    @property
    def data_ranks(self) -> int:  # ranks that each take their own slice of the batch (pipeline ranks share one)
        return 1 if self.pipeline is not None else self.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.block_size * self.cfg.grad_accum_steps * self.data_ranks

    @functools.cached_property
    def data_sha256(self) -> str:  # recorded in every checkpoint: a resumed run checks its data against it
        return text_sha256(self.text)

    def amp(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype else contextlib.nullcontext()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = get_batch(self.train_data, self.cfg.batch_size, self.block_size, self.generator,
                         rank=self.rank % self.data_ranks, world_size=self.data_ranks)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)  # (B, T), (B, T)

    def state_dict(self, optimizer_state: dict | None = None) -> dict:
        cuda = self.device.type == "cuda"
        return {
            "step": self.step, "best_val_loss": self.best_val, "losses": self.losses, "evals": self.evals,
            "optimizer": self.optimizer.state_dict() if optimizer_state is None else optimizer_state,
            "scaler": self.scaler.state_dict(),
            "batch_rng": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if cuda else None,
            "train_config": self.cfg.to_dict(), "data_name": self.data_name, "data_sha256": self.data_sha256,
            "world_size": self.world_size,
        }

    def restore(self, state: dict) -> None:
        if self.cfg.fsdp:  # a single-process-format state: every rank keeps its shard of it
            from ..parallel import fsdp

            fsdp.load_optimizer_state(self.raw_model, self.optimizer, state["optimizer"])
        elif self.pipeline is not None:  # each rank keeps the state of its stages' parameters
            self.pipeline.load_optimizer_state(self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.generator.set_state(state["batch_rng"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and state["cuda_rng"] is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.step, self.best_val = state["step"], state["best_val_loss"]
        self.losses, self.evals = list(state["losses"]), [list(e) for e in state["evals"]]

    def evaluate_and_save(self, bar) -> None:
        model, optimizer_state = self.raw_model, None
        if self.cfg.fsdp:  # every rank sends its shards; rank 0 evaluates and saves a plain model
            from ..parallel import fsdp

            model, optimizer_state = fsdp.gather_full_state(self.raw_model, self.optimizer)
            if self.rank != 0:
                return
        if self.pipeline is not None:  # every rank sends its stages; rank 0 evaluates and saves the whole model
            model, optimizer_state = self.pipeline.gather_full_state(self.optimizer)
            if self.rank != 0:
                return
        splits = {"train": self.train_data, "val": self.val_data}
        result = estimate_loss(model, splits, self.cfg, self.block_size, self.device, self.amp)
        self.evals.append([self.step, result["train"], result["val"]])
        if self.cfg.progress:
            bar.write(f"step {self.step}: train loss {result['train']:.4f}, val loss {result['val']:.4f}")
        out_dir = Path(self.cfg.out_dir)
        if result["val"] < self.best_val:
            self.best_val = result["val"]
            save_checkpoint(out_dir / "best", model, self.tokenizer, self.state_dict(optimizer_state))
        save_checkpoint(out_dir / "last", model, self.tokenizer, self.state_dict(optimizer_state))

    def diverged(self, loss_value: float, lr: float) -> TrainingDiverged:
        kept = Path(self.cfg.out_dir) / "last"
        return TrainingDiverged(
            f"loss is {loss_value} at step {self.step + 1} (lr {lr:.3g}); training stopped before updating the "
            f"weights. The last good checkpoint is {kept if kept.exists() else 'not written yet'}; "
            f"try a lower lr, a smaller grad_clip or precision=fp32"
        )


def _start(cfg: TrainConfig, model_cfg, ckpt: Path | None, rank: int, world_size: int, device,
           allow_data_change: bool = False) -> _Run:
    """Data, model, optimizer and RNGs of a new run, or of one resumed from `ckpt` restored exactly."""
    torch.manual_seed(cfg.seed)  # same init and same dropout stream on every rank (DDP checks nothing)
    text, tokenizer, model, state = _prepare(cfg, model_cfg, ckpt, allow_data_change)
    block_size = cfg.block_size or model.config.max_seq_len
    if block_size > model.config.max_seq_len:
        raise ValueError(f"block_size={block_size} exceeds the model's max_seq_len={model.config.max_seq_len}")
    cfg = replace(cfg, batch_size=cfg.sequences_per_batch(block_size))  # saved as a number: resume keeps it
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    train_data, val_data = split_tokens(ids, block_size)
    model.to(device)
    model.check_backend(training=True)  # refuse a backend that cannot train before building anything
    if cfg.fsdp:  # before the optimizer, which must see (and keep state for) the shards only
        from ..parallel.fsdp import shard_for_training

        shard_for_training(model)
    pipeline = None
    if cfg.pipeline_parallel > 1:  # this rank's stages are what it trains (and what its optimizer sees)
        from ..parallel.pp import PipelineTrainer

        pipeline = PipelineTrainer(model, cfg.schedule, cfg.microbatches, device)
    amp_dtype = None if pipeline is not None else autocast_dtype(cfg.precision, device)
    trained = model if pipeline is None else pipeline.local
    run = _Run(cfg, trained, model, tokenizer, text, state["data_name"], train_data, val_data, block_size,
               make_optimizer(trained, cfg), torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16),
               torch.Generator().manual_seed(cfg.seed), device, amp_dtype, rank, world_size, pipeline)
    if ckpt is not None:
        run.restore(state)
    if cfg.compile:
        run.model = torch.compile(run.model)
    if world_size > 1 and not cfg.fsdp and pipeline is None:
        from torch.nn.parallel import DistributedDataParallel

        run.model = DistributedDataParallel(run.model, device_ids=[device.index] if device.type == "cuda" else None)
    return run


def _train(run: _Run) -> TrainResult:
    """The loop: a step, its bookkeeping, and every eval_interval steps an evaluation and two checkpoints."""
    cfg, master = run.cfg, run.rank == 0
    bar = tqdm(total=cfg.max_steps, initial=run.step, disable=not (cfg.progress and master), desc="train")
    run.model.train()
    while run.step < cfg.max_steps:
        started = time.perf_counter()
        lr = lr_at(run.step, cfg)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        if run.pipeline is not None:  # the schedule runs the microbatches through this rank's stages
            loss_value = run.pipeline.step(*run.next_batch()).item()
        else:
            loss_value = forward_backward(run.model, run.next_batch, cfg, run.amp, run.scaler, run.world_size)
        if not math.isfinite(loss_value):  # checked BEFORE the update: the weights are still good
            bar.close()
            raise run.diverged(loss_value, lr)
        apply_update(run.model, run.optimizer, run.scaler, cfg.grad_clip, run.pipeline)
        run.step += 1
        run.losses.append(loss_value)
        run.step_times.append(time.perf_counter() - started)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", refresh=False,
                        tok_s=f"{run.tokens_per_step / run.step_times[-1]:.0f}")
        if (master or cfg.fsdp or run.pipeline) and (run.step % cfg.eval_interval == 0 or run.step == cfg.max_steps):
            run.evaluate_and_save(bar)
    bar.close()
    out_dir = Path(cfg.out_dir)
    if cfg.fsdp:  # a plain model for the samples and the result (rank 0); the others keep their shards
        from ..parallel.fsdp import gather_full_model

        run.raw_model = gather_full_model(run.raw_model) or run.raw_model
    if master:
        finish_run(cfg, run.raw_model, run.tokenizer, run.text, run.losses, run.evals, out_dir, run.device)
    return TrainResult(run.raw_model, run.tokenizer, run.step, run.best_val, run.losses, run.evals,
                       run.step_times, run.tokens_per_step, str(out_dir))
