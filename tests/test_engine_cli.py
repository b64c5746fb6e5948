"""`mini-transformer sample` with several prompts runs them through the engine: each completion equals
generate() on that prompt alone (greedy); benchmarks/bench_serving.py runs a tiny workload."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import save_char_checkpoint

from mini_transformer import generate
from mini_transformer.cli import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_char_checkpoint(tmp_path_factory.mktemp("char"), max_seq_len=40)


def expected_text(model, tokenizer, prompt, n):
    ids = generate(model, torch.tensor([tokenizer.encode(prompt)]), n)[0].tolist()
    return prompt + tokenizer.decode(ids) + "\n\n"


def test_several_prompts_go_through_the_engine(checkpoint, capsys, tmp_path):
    path, model, tokenizer = checkpoint
    prompts = ["the fox", "a lazy dog jumps", "pack"]
    file = tmp_path / "prompts.txt"
    file.write_text("pack\n\n", encoding="utf-8")
    code = main(["sample", "--checkpoint", str(path), "--prompt", prompts[0], "--prompt", prompts[1],
                 "--prompts-file", str(file), "--max-new-tokens", "12", "--temperature", "0"])
    assert code == 0
    assert capsys.readouterr().out == "".join(expected_text(model, tokenizer, p, 12) for p in prompts)


def test_engine_path_stops_at_the_context(checkpoint, capsys):
    path, model, tokenizer = checkpoint
    prompt = "the quick brown fox jumps over"  # 30 of 40 positions: 10 tokens of room
    code = main(["sample", "--checkpoint", str(path), "--prompt", prompt, "--prompt", "dog",
                 "--max-new-tokens", "25", "--temperature", "0"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith(expected_text(model, tokenizer, prompt, 10))


def test_missing_prompts_are_a_clear_error(checkpoint, capsys, tmp_path):
    path, _, _ = checkpoint
    assert main(["sample", "--checkpoint", str(path)]) == 2
    assert "--prompt" in capsys.readouterr().err
    assert main(["sample", "--checkpoint", str(path), "--prompts-file", str(tmp_path / "absent.txt")]) == 2
    assert "--prompts-file" in capsys.readouterr().err


def test_bench_serving_runs_a_tiny_workload():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serving.py"
    done = subprocess.run([sys.executable, str(script), "--requests", "3", "--min-len", "2", "--max-len", "6",
                           "--ways", "static", "--prefix-requests", "2", "--prefix-len", "8", "--suffix-len", "2",
                           "--prefix-output", "2", "--block-size", "4"], capture_output=True, text=True, timeout=600)
    code = done.returncode
    assert code == 0, done.stderr[-3000:]
    out = done.stdout
    assert "| engine |" in out and "engine outputs equal to generate()'s: 3 of 3 requests" in out
    assert "outputs with caching on equal those with it off: True" in out
