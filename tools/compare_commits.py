"""Before/after in one run: cached greedy decode tokens/s of two commits of this repository, side by side.

Each commit is checked out into a temporary git worktree and timed in its own subprocess (the package
imported from that tree); the commits take turns, round after round, so a change in machine load hits
both. Same model (GPT-2 layout, seeded random weights), same prompt, same threads. Besides wall time it
reports the process's CPU time per token, which a busy machine disturbs far less (with one thread).

    python tools/compare_commits.py 1ae7546 HEAD --new-tokens 512 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]

# Runs inside the subprocess, with the commit's src/ first on sys.path.
TIMER = r"""
import json, sys, time, torch
from mini_transformer import TransformerConfig, TransformerLM, generate
n_new, prompt_len, threads = (int(a) for a in sys.argv[1:4])
torch.set_num_threads(threads)
torch.manual_seed(0)
cfg = TransformerConfig(vocab_size=65, d_model=384, n_heads=6, n_layer=6, max_seq_len=1024, attn_backend="sdpa")
model = TransformerLM(cfg).eval()
idx = torch.randint(1, 65, (1, prompt_len))
generate(model, idx, 8)  # warm-up
start, cpu_start = time.perf_counter(), time.process_time()
out = generate(model, idx, n_new)
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": out[0, :16].tolist()}))
"""


def checkout(commit: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(into), commit],
                   check=True, capture_output=True)
    return into


def time_commit(tree: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run([sys.executable, "-c", TIMER, str(args.new_tokens), str(args.prompt_len), str(args.threads)],
                         env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {c: checkout(c, Path(tmp) / f"tree{i}") for i, c in enumerate((args.old, args.new))}
        try:
            runs: dict[str, list[float]] = {c: [] for c in trees}
            cpu: dict[str, list[float]] = {c: [] for c in trees}
            tokens = {}
            for _ in tqdm(range(args.rounds), desc="rounds"):
                for commit, tree in trees.items():
                    result = time_commit(tree, args)
                    runs[commit].append(result["seconds"])
                    cpu[commit].append(result["cpu_seconds"])
                    tokens[commit] = result["tokens"]
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    if tokens[args.old] != tokens[args.new]:
        raise SystemExit(f"the commits decode different tokens: {tokens}")
    print(f"\ncached greedy decode, GPT-2 layout 6x384, vocab 65, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, {args.threads} thread(s), median of {args.rounds} alternating rounds")
    print(f"{'commit':>12} | {'tok/s':>8} | {'ms/token':>8} | {'vs old':>7} | {'CPU ms/token':>12} | {'vs old':>7}")
    base, cpu_base = statistics.median(runs[args.old]), statistics.median(cpu[args.old])
    for commit in trees:
        s, c = statistics.median(runs[commit]), statistics.median(cpu[commit])
        print(f"{commit:>12} | {args.new_tokens / s:>8.1f} | {1000 * s / args.new_tokens:>8.3f} | {base / s:>6.3f}x"
              f" | {1000 * c / args.new_tokens:>12.3f} | {cpu_base / c:>6.3f}x")


if __name__ == "__main__":
    main()
