"""benchmarks/bench_decode_speed.py's timing loop, on stand-in methods (no model is timed here): every
warm-up and timed run happens in one grad mode, so a compiled method never recompiles inside a timed run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from mini_transformer import TransformerConfig, TransformerLM

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling _decode_roofline
    import bench_decode_speed

    return bench_decode_speed


def test_warm_up_and_timed_runs_share_one_grad_mode(bench, monkeypatch):
    """HF's generate runs under no_grad, not inference mode; a compiled forward warmed up in one mode and
    timed in the other recompiles in the first timed run (dynamo guards on the inputs' dispatch keys).
    Each stand-in method records the mode of every call it gets: one mode per method, and the compiled
    ones warm up at the timed length (their static graph)."""
    model = TransformerLM(TransformerConfig(vocab_size=16, d_model=8, n_heads=2, n_layer=1, d_ff=16,
                                            max_seq_len=64)).eval()
    calls = []

    def method(name):
        def run(idx, n):
            calls.append((name, n, torch.is_inference_mode_enabled()))
            return torch.zeros(1, n, dtype=torch.long)
        return run

    monkeypatch.setattr(bench, "build_pair", lambda name, max_len, device: (model, None))
    monkeypatch.setattr(bench, "speed_runners", lambda ours, hf, group_size: {
        m: (model, method(m)) for m in ("hf", "hf-static", "eager", "compiled")})
    args = argparse.Namespace(new_tokens=12, gpt2_new_tokens=12, prompt_len=4, group_size=4, repeats=2,
                              device="cpu", profile=[], methods=["hf", "hf-static", "eager", "compiled"])
    rows = bench.run_speed("char", args, bandwidth=1e9)

    assert [r["method"] for r in rows] == ["hf", "hf-static", "eager", "compiled"]
    assert len(calls) == 4 * (1 + args.repeats)
    for m in ("hf", "hf-static", "eager", "compiled"):
        modes = {inference for name, _, inference in calls if name == m}
        assert len(modes) == 1, f"{m} ran in both grad modes: warm-up and timed runs would be different graphs"
    warm_up = {name: n for name, n, _ in calls[:4]}
    assert warm_up == {"hf": 8, "hf-static": 12, "eager": 8, "compiled": 12}
