"""`mini-transformer train | sample | serve | bench | trace | info`: the command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from .config import PRESETS, TransformerConfig


def parse_overrides(pairs: list[str] | None) -> dict:
    """--set key=value ... -> {key: value}, values parsed as int, float, bool or string."""
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"--set {pair!r} must look like key=value")
        key, raw = pair.split("=", 1)
        lowered = raw.lower()
        if lowered in ("true", "false"):
            value: object = lowered == "true"
        elif lowered in ("none", "null"):
            value = None
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        out[key] = value
    return out


def config_from_args(args) -> TransformerConfig:
    return TransformerConfig.from_preset(args.preset, **parse_overrides(getattr(args, "set", None)))


# ----------------------------------------------------------------------------------------- info
def _add_info(sub) -> None:
    p = sub.add_parser("info", help="parameter count per component, memory of weights and KV cache")
    p.add_argument("--preset", default="gpt2-small", choices=sorted(PRESETS))
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field")
    p.set_defaults(func=_run_info)


def _run_info(args) -> None:
    from .info import describe

    print(describe(config_from_args(args)))


# ---------------------------------------------------------------------------------------- trace
def _add_trace(sub) -> None:
    p = sub.add_parser("trace", help="one forward pass, printing the tensor shape at every stage")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run_trace)


def _run_trace(args) -> None:
    from .trace import trace

    print(trace(config_from_args(args), batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed))


# --------------------------------------------------------------------------------------- sample
def _add_sample(sub) -> None:
    p = sub.add_parser("sample", help="continue prompts with a trained checkpoint (one streams; several run "
                                      "through the serving engine)")
    p.add_argument("--checkpoint", required=True, help="our checkpoint dir or a Hugging Face GPT-2/Llama dir")
    p.add_argument("--prompt", action="append", default=[],
                   help="text to continue; repeat it for several prompts (they run as one engine batch)")
    p.add_argument("--prompts-file", help="a text file with one prompt per line (empty lines skipped)")
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="tokens to generate; past the model's context the window slides")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="re-run the whole sequence every step (slow; to compare)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true",
                   help="decode from a static cache with a step compiled once (the first call compiles)")
    p.add_argument("--quantize", choices=["int8", "int4"], help="weight-only quantize every linear layer first")
    p.add_argument("--group-size", type=int, default=64, help="int4 group size (with --quantize int4)")
    p.add_argument("--draft-checkpoint", help="a small model sharing the tokenizer: speculative decoding")
    p.add_argument("--prompt-lookup", action="store_true", help="speculative decoding with n-gram drafts from the text")
    p.add_argument("--speculative-tokens", type=int, default=4, help="tokens drafted per target pass")
    p.add_argument("--tensor-parallel", action="store_true",
                   help="under torchrun: split heads, FFN and vocabulary over the ranks (rank 0 prints)")
    p.set_defaults(func=_run_sample)


class _TextStream:
    """Print each step's new text as soon as it is known (the tokenizer's IncrementalDecoder: a trailing
    window decoded per step, an unfinished character waits for the next token)."""

    def __init__(self, tokenizer, out, prompt: str):
        from .tokenizer import IncrementalDecoder

        self.decoder = IncrementalDecoder(tokenizer)
        self.out, self.prompt = out, prompt

    def __call__(self, step_ids) -> None:
        if not self.decoder.ids:  # the prompt is echoed once generation has really started (no error came first)
            self.out.write(self.prompt)
        self.out.write(self.decoder.add([int(step_ids[0])]))
        self.out.flush()

    def flush(self, final: bool = True) -> None:
        self.out.write(self.decoder.add([], final=final))
        self.out.flush()


def _run_sample(args) -> None:
    import torch

    from .checkpoint import resolve_checkpoint_dir
    from .generate import generate_long
    from .sampling import SamplingParams
    from .tokenizer import load_tokenizer
    from .train import resolve_device
    from .transformer import TransformerLM

    prompts = _read_prompts(args)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: max_new_tokens={args.max_new_tokens} must be a positive integer")
    params = SamplingParams(
        max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
    )
    device = resolve_device(args.device)
    checkpoint = resolve_checkpoint_dir(args.checkpoint)  # `best` is found even mid-save
    model = _load_sample_model(args, checkpoint, device)  # verifies the manifest first
    tokenizer = load_tokenizer(checkpoint)
    out = sys.stdout
    if args.tensor_parallel:  # every rank runs the same loop on its shard; only rank 0 prints
        if len(prompts) > 1:
            raise ValueError("--tensor-parallel continues one --prompt (several go through the engine, one process)")
        if args.quantize or args.compile or args.draft_checkpoint or args.prompt_lookup:
            raise ValueError("--tensor-parallel runs the plain model: leave out --quantize, --compile, "
                             "--draft-checkpoint and --prompt-lookup")
        from .parallel.tp import shard_for_command_line

        out = shard_for_command_line(model, device)
    if len(prompts) > 1:
        _sample_with_engine(model, tokenizer, prompts, params)
        return
    prompt_ids = tokenizer.encode(prompts[0])
    if not prompt_ids:
        raise ValueError("--prompt is empty; give at least one character of text to continue")
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
    stream = _TextStream(tokenizer, out, prompts[0])
    # past max_seq_len generate_long slides the context window (re-prefilling its second half)
    draft = "prompt_lookup" if args.prompt_lookup else None
    if args.draft_checkpoint:
        draft = TransformerLM.from_pretrained(args.draft_checkpoint, device=device)
    generate_long(model, idx, params, eos_token_id=tokenizer.eos_token_id, use_cache=not args.no_cache,
                  stream=stream, compile=args.compile, draft_model=draft,
                  num_speculative_tokens=args.speculative_tokens)
    stream.flush()
    out.write("\n")


def _load_sample_model(args, checkpoint, device):
    """The checkpoint (float, or quantized as saved by quantize.save_quantized), quantized if --quantize asks."""
    from .quantize import quantize
    from .transformer import TransformerLM

    if args.draft_checkpoint and args.prompt_lookup:
        raise ValueError("--draft-checkpoint and --prompt-lookup are two drafters; choose one")
    model = TransformerLM.from_pretrained(checkpoint, device=device)
    if not args.quantize:
        return model
    if getattr(model, "quantization", None):
        raise ValueError(f"--checkpoint {args.checkpoint} is already quantized; drop --quantize")
    return quantize(model, args.quantize, group_size=args.group_size)


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            text = Path(args.prompts_file).read_text(encoding="utf-8")
        except OSError as err:
            raise ValueError(f"--prompts-file {args.prompts_file!r} cannot be read: {err.strerror}") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give a prompt: --prompt TEXT (repeat it for several) or --prompts-file FILE")
    return prompts


def _sample_with_engine(model, tokenizer, prompts: list[str], params) -> None:
    """Several prompts as one batch of requests in the serving engine; each prompt gets its own seed
    (seed + i), so a completion does not depend on the others. The completions print in prompt order."""
    from .engine import LLMEngine

    context = model.config.max_seq_len
    ids, per_prompt = [], []
    for i, prompt in enumerate(prompts):
        prompt_ids = tokenizer.encode(prompt)
        if not prompt_ids or len(prompt_ids) >= context:
            raise ValueError(f"prompt {i + 1} ({prompt[:40]!r}) encodes to {len(prompt_ids)} tokens; the engine "
                             f"needs 1 to {context - 1} (the model's max_seq_len is {context})")
        room = min(params.max_tokens, context - len(prompt_ids))  # the engine does not slide past the context
        seed = None if params.seed is None else params.seed + i
        ids.append(prompt_ids)
        per_prompt.append(dataclasses.replace(params, max_tokens=room, seed=seed))
    engine = LLMEngine(model, eos_token_id=tokenizer.eos_token_id, max_num_seqs=max(1, len(prompts)))
    for prompt, completion in zip(prompts, engine.generate(ids, per_prompt), strict=True):
        sys.stdout.write(prompt + tokenizer.decode(completion) + "\n\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------- train
DEFAULT_TRAIN_PRESET = "shakespeare-char"
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
    from .train import TrainConfig

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
    if args.resume:  # the run continues with its saved settings; what is given here overrides them
        from .train_io import find_checkpoint, load_train_state

        if args.preset is not None:
            raise ValueError("--preset cannot be combined with --resume: the model comes from the checkpoint "
                             "(change single fields with --set KEY=VALUE)")
        checkpoint = find_checkpoint(args.resume)
        saved = load_train_state(checkpoint)["train_config"]
        given.setdefault("out_dir", str(checkpoint.parent))  # keep writing next to the checkpoint resumed from
        return TrainConfig.from_dict({**saved, **given}), model_set
    preset = args.preset or DEFAULT_TRAIN_PRESET
    given.setdefault("out_dir", str(Path("out") / preset))
    if "vocab_size" in model_set:
        raise ValueError("--set vocab_size is not allowed for train: the vocabulary comes from the tokenizer "
                         "(use --tokenizer bpe --vocab-size N)")
    return TrainConfig.from_dict(given), TransformerConfig.from_preset(preset, **model_set)


def _run_train(args) -> None:
    from .train import train

    train_cfg, model_cfg = train_configs_from_args(args)
    result = train(train_cfg, model_cfg, resume=args.resume, overwrite=args.overwrite)
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


# ---------------------------------------------------------------------------------------- bench
BENCHMARKS = ("decode", "attention", "train", "serving", "moe", "server")


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="run a script of benchmarks/ (from a clone of the repository)")
    p.add_argument("name", choices=BENCHMARKS, help=" | ".join(BENCHMARKS))
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="passed on to the script (see its --help)")
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> None:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / f"bench_{args.name}.py"
    if not script.is_file():
        raise ValueError(f"no benchmark script at {script}: `bench` runs from a clone of the repository")
    sys.argv = [str(script), *args.script_args]
    runpy.run_path(str(script), run_name="__main__")


# ---------------------------------------------------------------------------------------- serve
def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (and a live page at /) on the engine")
    p.add_argument("--checkpoint", required=True, help="our checkpoint dir or a Hugging Face GPT-2/Llama dir")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--model-name", help="the model id clients send (default: the checkpoint directory's name)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--kv-cache-bytes", type=int, help="memory for the KV block pool (default: the engine's)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    p.add_argument("--max-waiting", type=int, default=256, help="requests queued beyond that before 429")
    p.add_argument("--device", default="cpu")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=_run_serve)


def _run_serve(args) -> None:
    from .server import build_context, serve

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in [0, 65535]")
    ctx = build_context(args.checkpoint, model_name=args.model_name, api_key=args.api_key,
                        block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_waiting=args.max_waiting, device=args.device)
    print(f"serving {ctx.model_name!r} on http://{args.host}:{args.port} (live page at /, API under /v1)",
          flush=True)
    serve(ctx, host=args.host, port=args.port, log_level=args.log_level)


# ----------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mini-transformer", description="A decoder-only Transformer written by hand in PyTorch."
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_info(sub)
    _add_trace(sub)
    _add_sample(sub)
    _add_train(sub)
    _add_serve(sub)
    _add_bench(sub)
    for command in sub.choices.values():  # `--debug` also works after the command's name
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Failures a user can cause (bad values, files, data, a diverging run, too big a model): one line each."""
    import torch
    from safetensors import SafetensorError

    from .data import DatasetUnavailable
    from .train_io import TrainingDiverged

    return (ValueError, TypeError, OSError, SafetensorError, DatasetUnavailable, TrainingDiverged, MemoryError,
            torch.OutOfMemoryError)


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every failure is one line on stderr and a non-zero exit (2: the input, 1: a bug
    or the environment); `--debug` shows the traceback instead."""
    args = build_parser().parse_args(argv)
    prefix = f"mini-transformer {args.command}"
    try:
        args.func(args)
    except BrokenPipeError:  # output piped into `head` and closed early: not an error
        sys.stderr.close()
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if args.debug:
            raise
        message = " ".join(str(err).split()) or type(err).__name__  # one line, whatever the exception held
        out_of_memory = isinstance(err, RuntimeError) and "can't allocate memory" in message  # CPU allocator
        if isinstance(err, _user_errors()) or out_of_memory:
            print(f"{prefix}: error: {message}", file=sys.stderr)
            return 2
        print(f"{prefix}: internal error: {type(err).__name__}: {message} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
