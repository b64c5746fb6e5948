"""`mini-transformer info | trace | train | sample`: the command line."""

from __future__ import annotations

import argparse
import sys

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


# ----------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mini-transformer", description="A decoder-only Transformer written by hand in PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_info(sub)
    _add_trace(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, TypeError) as err:
        print(f"mini-transformer {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early: not an error
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
