"""`mini-transformer bench NAME [ARGS]`: run a script of benchmarks/ with its own arguments."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCHMARKS = ("decode", "attention", "train", "serving", "moe", "server", "structured")


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="run a script of benchmarks/ (from a clone of the repository)")
    p.add_argument("name", choices=BENCHMARKS, help=" | ".join(BENCHMARKS))
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="passed on to the script (see its --help)")
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> None:
    import runpy

    root = Path(__file__).resolve().parents[3]  # src/mini_transformer/cli/ -> the clone's root
    script = root / "benchmarks" / f"bench_{args.name}.py"
    if not script.is_file():
        raise ValueError(f"no benchmark script at {script}: `bench` runs from a clone of the repository")
    sys.argv = [str(script), *args.script_args]
    # `python benchmarks/x.py` puts benchmarks/ first on the path, so a script may import its siblings
    # (decode_roofline, bench_attention); run_path does not, so do the same here for the run.
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.path.remove(str(script.parent))
