"""benchmarks/bench_roofline.py's arithmetic: one decode step's FLOPs and bytes, counted by hand for a small
GPT-2-layout model, and the memory/compute verdict against a given ridge point (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mini_transformer import TransformerConfig

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling _decode_roofline
    import bench_roofline

    return bench_roofline


def test_step_cost_counts_weights_once_and_kv_per_sequence(bench):
    cfg = TransformerConfig(vocab_size=10, n_layer=2, n_heads=2, d_model=8, d_ff=32, max_seq_len=64)
    C, L, F, V, D, H = 8, 2, 32, 10, 4, 2
    linear = L * (C * 3 * C + C * C + C * F + F * C) + V * C  # W_qkv, W_o, fc1, fc2; the tied head
    biases = L * (3 * C + C + F + C)
    norms = (2 * L + 1) * 2 * C  # LayerNorm weight and bias: norm_1, norm_2 per layer, norm_f
    rows = 2 * C  # one row of the token table and one of the position table
    for batch, context in ((1, 0), (3, 5)):
        keys = context + 1
        flops, nbytes = bench.step_cost(cfg, batch, context)
        assert flops == batch * (2 * linear + 4 * L * H * D * keys)
        assert nbytes == 4 * (linear + biases + norms + rows) + batch * keys * 2 * L * H * D * 4


def test_intensity_grows_with_batch_and_crosses_the_ridge(bench):
    rows = bench.roofline_rows(bandwidth=1e10, peak_flops=3e10, context=16, batches=(1, 4, 16, 64))
    for name in bench.MODELS:
        mine = [r for r in rows if r["model"] == name]
        assert [r["intensity"] for r in mine] == sorted(r["intensity"] for r in mine)
        assert mine[0]["bound"] == "memory" and mine[0]["intensity"] == pytest.approx(0.5, rel=0.05)
        assert all(r["attainable"] <= 3e10 for r in mine)
        for r in mine:
            assert (r["bound"] == "compute") == (r["intensity"] >= 3.0)
