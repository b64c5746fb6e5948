"""`mini-transformer train | sample | serve | cluster | trace | info`: the command line.

One module per command (sample_command.py, train_command.py, serve_command.py, cluster_command.py); the
two commands that only look at a config, `info` and `trace`, and what every command shares (the parser,
the one-line errors and their exit codes) stay here. `python -m mini_transformer.cli` runs __main__.py.
"""

from __future__ import annotations

import argparse
import sys

from ..config import PRESETS
from .cluster_command import _add_cluster
from .options import config_from_args, parse_overrides
from .sample_command import _add_sample, _TextStream
from .serve_command import _add_serve
from .train_command import DEFAULT_TRAIN_PRESET, _add_train, train_configs_from_args

__all__ = ["DEFAULT_TRAIN_PRESET", "build_parser", "config_from_args", "main", "parse_overrides",
           "train_configs_from_args", "_TextStream"]


# ----------------------------------------------------------------------------------------- info
def _add_info(sub) -> None:
    p = sub.add_parser("info", help="parameter count per component, memory of weights and KV cache")
    p.add_argument("--preset", default="gpt2-small", choices=sorted(PRESETS))
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="describe this checkpoint (ours or a Hugging Face directory) as it would load, "
                        "attention backend included, instead of a preset")
    p.set_defaults(func=_run_info)


def _run_info(args) -> None:
    from .info import describe

    if args.checkpoint:
        from ..checkpoint import read_config

        print(describe(read_config(args.checkpoint, **parse_overrides(args.set))))
        return
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
    _add_cluster(sub)
    for command in sub.choices.values():  # `--debug` also works after the command's name
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Failures a user can cause (bad values, files, data, a diverging run, too big a model): one line each."""
    import torch
    from safetensors import SafetensorError

    from ..training.data import DatasetUnavailable
    from ..training.io import TrainingDiverged

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

