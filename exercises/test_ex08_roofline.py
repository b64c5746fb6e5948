"""Grader for ex08_roofline: bytes, FLOPs, the bandwidth ceiling and the ridge point of a decode step,
checked against numbers counted by hand for a 1B Llama-shaped model (and a plain reference for others)."""

from __future__ import annotations

import math

EXERCISE = "ex08_roofline"

# two machines, given as inputs: a GPU's data-sheet numbers (bf16 dense, HBM) and one CPU core as docs/08a
# measured it (fp32 matmul, read-only bandwidth)
GPU = dict(peak_flops=989e12, bandwidth=3.35e12)
CPU = dict(peak_flops=111.3e9, bandwidth=41.9e9)
LLAMA_1B = dict(vocab_size=128256, d_model=2048, n_layer=16, n_heads=32, n_kv_heads=8, d_ff=8192)
SMALL_MHA = dict(vocab_size=65, d_model=384, n_layer=6, n_heads=6, n_kv_heads=6, d_ff=1024)
ODD_GQA = dict(vocab_size=1000, d_model=96, n_layer=3, n_heads=12, n_kv_heads=4, d_ff=160)


def reference(cfg, batch, context, b):
    """(linear params, weight bytes, kv bytes per token, FLOPs, bytes) of one step, matrix by matrix."""
    C, L, V, F = cfg["d_model"], cfg["n_layer"], cfg["vocab_size"], cfg["d_ff"]
    H, Hkv = cfg["n_heads"], cfg["n_kv_heads"]
    D = C // H
    per_layer = [C * H * D, C * Hkv * D, C * Hkv * D, H * D * C, C * F, C * F, F * C]  # q k v o gate up down
    linear = L * sum(per_layer) + C * V  # + the output head
    values = linear + (2 * L + 1) * C + C  # + norms' scales + one embedding row
    kv = 2 * L * Hkv * D * b
    keys = context + 1
    flops = batch * (2 * linear + 2 * 2 * L * H * D * keys)  # q·k and p·v: a multiply and an add each
    return linear, values * b, kv, flops, values * b + batch * keys * kv


def test_linear_params_of_a_1b_llama(solution):
    m = solution.Model(**LLAMA_1B)
    # one layer: q, o 2048² each; k, v 2048·512 each; gate, up, down 2048·8192 each = 60,817,408
    assert solution.linear_params(m) == 16 * 60_817_408 + 128256 * 2048 == 1_235_746_816
    for cfg in (SMALL_MHA, ODD_GQA):
        assert solution.linear_params(solution.Model(**cfg)) == reference(cfg, 1, 0, 4)[0], cfg


def test_weight_bytes_count_norms_and_one_embedding_row(solution):
    m = solution.Model(**LLAMA_1B)
    # linear 1,235,746,816 + norms 33 · 2048 + one embedding row 2048 = 1,235,816,448 values
    assert solution.weight_bytes(m, 2) == 2 * 1_235_816_448, "bf16: linear layers + norms + ONE embedding row"
    assert solution.weight_bytes(m, 4) == 4 * 1_235_816_448
    for cfg in (SMALL_MHA, ODD_GQA):
        assert solution.weight_bytes(solution.Model(**cfg), 4) == reference(cfg, 1, 0, 4)[1], cfg


def test_kv_bytes_per_token_hold_k_and_v_of_the_kv_heads(solution):
    assert solution.kv_bytes_per_token(solution.Model(**LLAMA_1B), 2) == 2 * 16 * 8 * 64 * 2 == 32_768
    assert solution.kv_bytes_per_token(solution.Model(**SMALL_MHA), 4) == 2 * 6 * 6 * 64 * 4 == 18_432
    assert solution.kv_bytes_per_token(solution.Model(**ODD_GQA), 4) == reference(ODD_GQA, 1, 0, 4)[2]


def test_step_flops_and_bytes(solution):
    m = solution.Model(**LLAMA_1B)
    # batch 1, 1023 cached: 2 · 1,235,746,816 + 4 · 16 · 32 · 64 · 1024 FLOPs; weights + 1024 · 32,768 bytes
    assert solution.step_flops(m, 1, 1023) == 2_605_711_360
    assert solution.step_bytes(m, 1, 1023, 2) == 2_471_632_896 + 33_554_432
    for cfg in (LLAMA_1B, SMALL_MHA, ODD_GQA):
        model = solution.Model(**cfg)
        for batch, context, b in ((1, 0, 4), (8, 255, 4), (64, 2047, 2)):
            _, _, _, flops, nbytes = reference(cfg, batch, context, b)
            assert solution.step_flops(model, batch, context) == flops, (cfg, batch, context)
            assert solution.step_bytes(model, batch, context, b) == nbytes, (cfg, batch, context, b)


def test_the_batch_1_ceiling_is_bandwidth_over_bytes(solution):
    m = solution.Model(**LLAMA_1B)
    got = solution.max_tokens_per_s(m, 1023, 2, GPU["bandwidth"])
    assert math.isclose(got, 3.35e12 / 2_505_187_328, rel_tol=1e-12), f"{got:.1f} tok/s, expected about 1337.2"
    got = solution.max_tokens_per_s(solution.Model(**SMALL_MHA), 255, 4, CPU["bandwidth"])
    assert math.isclose(got, CPU["bandwidth"] / reference(SMALL_MHA, 1, 255, 4)[4], rel_tol=1e-12)


def test_the_ridge_point(solution):
    assert math.isclose(solution.ridge_point(**GPU), 989e12 / 3.35e12, rel_tol=1e-12)  # about 295 FLOP/byte
    assert math.isclose(solution.ridge_point(**CPU), 111.3 / 41.9, rel_tol=1e-12)  # about 2.66


def test_the_ridge_batch(solution):
    m = solution.Model(**LLAMA_1B)
    assert solution.ridge_batch(m, 255, 4, **CPU) == 6, "fp32 on one CPU core: compute-bound from batch 6"
    assert solution.ridge_batch(m, 127, 2, **GPU) == 584, "bf16 on the GPU: hundreds of sequences per step"
    for cfg, context, b, machine in ((SMALL_MHA, 255, 4, CPU), (ODD_GQA, 63, 4, CPU), (LLAMA_1B, 31, 2, GPU)):
        ridge = machine["peak_flops"] / machine["bandwidth"]
        batch = solution.ridge_batch(solution.Model(**cfg), context, b, **machine)
        assert batch is not None and batch >= 1, (cfg, context)
        at = [reference(cfg, n, context, b) for n in (batch - 1, batch)]
        assert at[1][3] / at[1][4] >= ridge, f"{cfg}: batch {batch} is still memory-bound"
        assert batch == 1 or at[0][3] / at[0][4] < ridge, f"{cfg}: batch {batch - 1} already reaches the ridge"


def test_no_batch_reaches_the_ridge_when_the_kv_bytes_dominate(solution):
    """Each sequence's K/V is read once per step whatever the batch: at 1023 cached tokens a sequence brings
    about 78 FLOPs per byte of its own K/V, below the GPU's ridge of 295, so no batch is compute-bound."""
    assert solution.ridge_batch(solution.Model(**LLAMA_1B), 1023, 2, **GPU) is None
