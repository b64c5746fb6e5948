"""`mini-transformer train`: its flags, how they (and --set) split into the training and the model
config, and the hint printed at the end of a run."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..config import PRESETS, TransformerConfig
from .options import parse_overrides

DEFAULT_TRAIN_PRESET = "shakespeare-char"
# Caps the steps of every `train`, and changes nothing else: tests/test_readme.py runs the README's commands
# verbatim with MINI_TRANSFORMER_MAX_STEPS=20, so they take seconds instead of minutes.
MAX_STEPS_ENV = "MINI_TRANSFORMER_MAX_STEPS"
_TRAIN_FLAGS = {  # flag -> (TrainConfig field, type, help)
    "--tokenizer": ("tokenizer", str, "char (default) or bpe"),
    "--vocab-size": ("bpe_vocab_size", int, "BPE vocabulary size (with --tokenizer bpe)"),
    "--batch-size": ("batch_size", int, "sequences per micro-batch and rank"),
    "--block-size": ("block_size", int, "tokens per sequence (default: the model's max_seq_len)"),
    "--grad-accum-steps": ("grad_accum_steps", int, "micro-batches per optimizer step"),
    "--lr": ("lr", float, "peak learning rate"),
    "--min-lr": ("min_lr", float, "learning rate at the end of the cosine"),
    "--warmup-steps": ("warmup_steps", int, "linear warmup steps"),
    "--weight-decay": ("weight_decay", float, "AdamW weight decay on >= 2-D weights"),
    "--grad-clip": ("grad_clip", float, "max gradient norm (0 = off)"),
    "--eval-interval": ("eval_interval", int, "steps between evaluations and checkpoints"),
    "--eval-batches": ("eval_batches", int, "batches per evaluation"),
    "--device": ("device", str, "auto | cpu | cuda | cuda:N | mps"),
    "--precision": ("precision", str, "auto | fp32 | bf16 | fp16 (autocast)"),
    "--seed": ("seed", int, "random seed"),
    "--pipeline-parallel": ("pipeline_parallel", int, "under torchrun with this many ranks: split the layers "
                            "into pipeline stages (torch.distributed.pipelining)"),
    "--microbatches": ("microbatches", int, "pipeline: microbatches per batch (batch size divisible by it)"),
    "--schedule": ("schedule", str, "pipeline: gpipe | 1f1b (default) | interleaved-1f1b (2 stages per rank)"),
}


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model on text (tiny shakespeare by default), then sample from it")
    p.add_argument("--data", help="shakespeare | pydoc | PATH (default: shakespeare, or pydoc when offline)")
    p.add_argument("--preset", choices=sorted(PRESETS), help=f"the model (default {DEFAULT_TRAIN_PRESET})")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a model or training config field, e.g. --set pos_emb=rope --set min_lr=3e-4")
    p.add_argument("--max-steps", type=int, help="optimizer steps to train (default 2000)")
    p.add_argument("--out", help="run directory (default out/<preset>); checkpoints go to OUT/best and OUT/last")
    p.add_argument("--resume", metavar="DIR", help="continue a run from its directory or a checkpoint directory")
    p.add_argument("--allow-data-change", action="store_true",
                   help="with --resume: continue even if the training data's sha256 differs from the run's")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --out (its checkpoints are deleted); default: refuse")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    p.add_argument("--fsdp", action="store_true", default=None,
                   help="under torchrun: shard weights, gradients and optimizer state (FSDP2) instead of DDP")
    for flag, (_, kind, help_text) in _TRAIN_FLAGS.items():
        p.add_argument(flag, type=kind, help=help_text)
    p.set_defaults(func=_run_train)


def train_configs_from_args(args):
    """-> (TrainConfig, model config or overrides). --set keys go to whichever config has that field."""
    from ..training.config import TrainConfig

    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    model_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    model_set, train_set = {}, {}
    for key, value in parse_overrides(args.set).items():
        if key in model_fields:
            model_set[key] = value
        elif key in train_fields:
            train_set[key] = value
        else:
            raise ValueError(f"--set {key}=... is not a model or training field; expected one of "
                             f"{sorted(model_fields | train_fields)}")
    given = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _, _) in _TRAIN_FLAGS.items()}
    given.update(data=args.data, max_steps=args.max_steps, compile=args.compile, out_dir=args.out, fsdp=args.fsdp)
    given = {**{k: v for k, v in given.items() if v is not None}, **train_set}
    if args.allow_data_change and not args.resume:
        raise ValueError("--allow-data-change goes with --resume only: a new run records its data")
    if args.resume:  # the run continues with its saved settings; what is given here overrides them
        from ..training.io import find_checkpoint, load_train_state

        if args.preset is not None:
            raise ValueError("--preset cannot be combined with --resume: the model comes from the checkpoint "
                             "(change single fields with --set KEY=VALUE)")
        checkpoint = find_checkpoint(args.resume)
        state = load_train_state(checkpoint)
        saved = state["train_config"]
        given.setdefault("data", state["data_name"])  # the run's own text, by a name found from any directory
        given.setdefault("out_dir", str(checkpoint.parent))  # keep writing next to the checkpoint resumed from
        return _cap_steps(TrainConfig.from_dict({**saved, **given})), model_set
    preset = args.preset or DEFAULT_TRAIN_PRESET
    given.setdefault("out_dir", str(Path("out") / preset))
    if "vocab_size" in model_set:
        raise ValueError("--set vocab_size is not allowed for train: the vocabulary comes from the tokenizer "
                         "(use --tokenizer bpe --vocab-size N)")
    return _cap_steps(TrainConfig.from_dict(given)), TransformerConfig.from_preset(preset, **model_set)


def _cap_steps(cfg):
    """cfg with max_steps at most $MINI_TRANSFORMER_MAX_STEPS (when set)."""
    value = os.environ.get(MAX_STEPS_ENV)
    if value is None:
        return cfg
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{MAX_STEPS_ENV}={value!r} must be a positive integer (or unset)")
    return dataclasses.replace(cfg, max_steps=min(cfg.max_steps, int(value)))


def _run_train(args) -> None:
    from ..training.loop import train

    train_cfg, model_cfg = train_configs_from_args(args)
    result = train(train_cfg, model_cfg, resume=args.resume, overwrite=args.overwrite,
                   allow_data_change=args.allow_data_change)
    if int(os.environ.get("RANK", "0")) == 0:
        best = Path(result.out_dir) / "best"
        print(f"best val loss {result.best_val_loss:.4f}; loss curve {Path(result.out_dir) / 'loss.png'}")
        prompt = next(p for p in ("ROMEO:", "The ", result.tokenizer.decode([0])) if _encodes(result.tokenizer, p))
        print(f"sample from it: mini-transformer sample --checkpoint {best} --prompt {prompt!r}")


def _encodes(tokenizer, text: str) -> bool:
    try:
        return bool(tokenizer.encode(text))
    except ValueError:
        return False
