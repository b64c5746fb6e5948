"""TrainConfig: everything about HOW to train, validated once (the model's shape lives in TransformerConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from .._checks import boolean, choice, non_negative_int, number, positive_int, string
from ..config import DictIO

Precision = Literal["auto", "fp32", "bf16", "fp16"]  # auto: bf16/fp16 autocast on CUDA, fp32 elsewhere
TokenizerKind = Literal["char", "bpe"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]  # torch.distributed.pipelining's schedules
PRECISIONS, TOKENIZERS, PIPELINE_SCHEDULES = get_args(Precision), get_args(TokenizerKind), get_args(PipelineSchedule)
# Tokens per micro-batch when batch_size is left out: nanoGPT's CPU "baby" run cuts 12 sequences of 64. Keeping
# the tokens (not the sequences) fixed lets a longer context train in about the same time per step.
BATCH_TOKENS = 768


@dataclass
class TrainConfig(DictIO):
    """Everything about HOW to train (the model's shape lives in TransformerConfig).

    Defaults follow nanoGPT's CPU "baby" Shakespeare run (lr, schedule, 2000 steps, 768 tokens per step).
    """

    data: str | None = None  # shakespeare | pydoc | a file path; None = shakespeare, else pydoc
    tokenizer: TokenizerKind = "char"
    bpe_vocab_size: int = 1024  # only for tokenizer="bpe"
    batch_size: int | None = None  # sequences per micro-batch, per rank; None = BATCH_TOKENS // block_size
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
    precision: Precision = "auto"
    compile: bool = False
    fused_optimizer: bool = True  # one fused AdamW kernel instead of a loop over tensors
    out_dir: str = "out"
    num_samples: int = 2  # texts sampled at the end
    sample_tokens: int = 300
    progress: bool = True
    fsdp: bool = False  # under torchrun: FSDP2 shards weights, grads and AdamW state (parallel/fsdp.py), not DDP
    pipeline_parallel: int = 1  # under torchrun with this many ranks: the layers split into stages (parallel/pp.py)
    microbatches: int = 1  # pipeline: the batch of batch_size sequences is cut into this many
    schedule: PipelineSchedule = "1f1b"  # pipeline: the order of the microbatches' forwards and backwards

    def __post_init__(self) -> None:
        choice("tokenizer", self.tokenizer, TOKENIZERS)
        choice("precision", self.precision, PRECISIONS)
        choice("schedule", self.schedule, PIPELINE_SCHEDULES)
        for name in ("bpe_vocab_size", "grad_accum_steps", "max_steps", "eval_interval",
                     "eval_batches", "sample_tokens", "pipeline_parallel", "microbatches"):
            positive_int(name, getattr(self, name))
        for name in ("batch_size", "block_size", "lr_decay_steps"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        for name in ("num_samples", "seed"):
            non_negative_int(name, getattr(self, name))
        if self.warmup_steps is not None:
            non_negative_int("warmup_steps", self.warmup_steps)
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            number(name, getattr(self, name), low=0.0, expected="a non-negative finite number")
        if self.lr <= 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 < min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        for name in ("beta1", "beta2"):
            number(name, getattr(self, name), low=0.0, high=1.0, high_open=True)
        if self.warmup_steps is not None and self.warmup_steps >= self.decay_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} must be smaller than lr_decay_steps (or max_steps)="
                f"{self.decay_steps}"
            )
        for name in ("compile", "fused_optimizer", "progress", "fsdp"):
            boolean(name, getattr(self, name))
        for name in ("device", "out_dir"):
            string(name, getattr(self, name))
        if self.pipeline_parallel > 1:
            self._check_pipeline()

    def _check_pipeline(self) -> None:
        """What pipeline parallelism cannot be combined with (the model-dependent checks are parallel/pp.py's)."""
        clash = {"fsdp": self.fsdp, "compile": self.compile, "grad_accum_steps > 1": self.grad_accum_steps > 1,
                 f"precision={self.precision}": self.precision not in ("auto", "fp32")}
        for name, given in clash.items():
            if given:
                raise ValueError(f"pipeline_parallel={self.pipeline_parallel} does not go with {name}: the pipeline "
                                 f"trains in fp32, and its microbatches already are the gradient accumulation")
        if self.batch_size is not None and self.batch_size % self.microbatches:
            raise ValueError(f"batch_size={self.batch_size} must be divisible by microbatches={self.microbatches} "
                             f"(equal microbatches: the mean of their losses is the batch's loss)")

    def sequences_per_batch(self, block_size: int) -> int:
        """batch_size, or as many sequences of `block_size` as fill BATCH_TOKENS (3 at 256, 12 at 64)."""
        return self.batch_size if self.batch_size is not None else max(1, BATCH_TOKENS // block_size)

    @property
    def decay_steps(self) -> int:
        return self.lr_decay_steps if self.lr_decay_steps is not None else self.max_steps

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else min(100, self.decay_steps // 10)
