"""Grader for ex03_kv_cache: the KV cache. Reference: the project's model recomputing the whole sequence."""

from __future__ import annotations

import torch

from mini_transformer import TransformerConfig, TransformerLM

EXERCISE = "ex03_kv_cache"


def new_cache(solution, model, batch_size, max_len=24):
    cfg = model.config
    return solution.KVCache(cfg.n_layer, batch_size, max_len, cfg.n_kv_heads, cfg.d_head)


def model_for(preset):
    return TransformerLM(TransformerConfig.from_preset(preset, max_seq_len=32)).eval()


def test_begin_numbers_the_new_tokens_after_the_old(solution):
    cache = solution.KVCache(1, 2, 8, 1, 4)
    assert cache.begin(torch.zeros(2, 3, dtype=torch.long), None).tolist() == [[0, 1, 2], [0, 1, 2]]
    assert cache.length == 3, "begin must reserve T slots"
    assert cache.begin(torch.zeros(2, 1, dtype=torch.long), None).tolist() == [[3], [3]], "the 4th token is at 3"
    assert cache.length == 4


def test_begin_counts_real_tokens_only(solution):
    cache = solution.KVCache(1, 2, 8, 1, 4)
    mask = torch.tensor([[0, 0, 1], [1, 1, 1]])  # row 0 is left-padded by two
    positions = cache.begin(torch.zeros(2, 3, dtype=torch.long), mask)
    assert positions[0, 2] == 0 and positions[1].tolist() == [0, 1, 2], "a row's first real token is position 0"
    assert (positions >= 0).all(), "padded slots need a valid position (>= 0) too"
    assert cache.begin(torch.zeros(2, 1, dtype=torch.long), None).tolist() == [[1], [3]], "padding must not count"


def test_attend_appends_keys_and_masks_padding(solution):
    cache = solution.KVCache(2, 1, 8, 2, 4)
    seen = {}

    def spy(q, k_all, v_all, key_padding_mask):
        seen.update(k=k_all.clone(), v=v_all.clone(), mask=key_padding_mask)
        return q

    cache.begin(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[0, 1, 1]]))
    k1, v1 = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    cache.attend(1, torch.randn(1, 4, 3, 4), k1, v1, spy)
    cache.begin(torch.zeros(1, 1, dtype=torch.long), None)
    k2, v2 = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    cache.attend(1, torch.randn(1, 4, 1, 4), k2, v2, spy)
    assert seen["k"].shape == (1, 2, 4, 4), f"attend must see all 4 slots (B, Hkv, 4, D), got {tuple(seen['k'].shape)}"
    assert torch.equal(seen["k"], torch.cat([k1, k2], dim=2)), "keys: the old ones, then the new one after them"
    assert torch.equal(seen["v"], torch.cat([v1, v2], dim=2)), "values: the old ones, then the new one after them"
    assert seen["mask"] is not None and seen["mask"].tolist() == [[False, True, True, True]], \
        "the padded slot must stay masked in every later step"


def check_decode(solution, model, prompt, mask=None, steps=4):
    B = prompt.shape[0]
    cache = new_cache(solution, model, B)
    with torch.no_grad():
        logits = model.logits(prompt, attention_mask=mask, cache=cache)
        seq, full_mask = prompt, mask
        token = logits[:, -1].argmax(-1)
        for step in range(steps):
            seq = torch.cat([seq, token[:, None]], dim=1)
            if full_mask is not None:
                full_mask = torch.cat([full_mask, torch.ones(B, 1, dtype=full_mask.dtype)], dim=1)
            got = solution.decode_step(model, token, cache)
            assert got.shape == (B, model.config.vocab_size), f"decode_step returns (B, V), got {tuple(got.shape)}"
            expected = model(seq, attention_mask=full_mask)[0][:, -1]
            err = (got - expected).abs().max().item()
            assert err <= 1e-5, f"decode step {step}: logits {err:.3g} away from recomputing the whole sequence"
            token = expected.argmax(-1)


def test_decode_equals_full_recompute_learned_positions(solution):
    check_decode(solution, model_for("tiny"), torch.randint(0, 100, (2, 5)))


def test_decode_equals_full_recompute_rope_gqa(solution):
    check_decode(solution, model_for("llama-tiny"), torch.randint(0, 100, (2, 5)))


def test_left_padded_batch_decodes_like_full_recompute(solution):
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    check_decode(solution, model_for("llama-tiny"), torch.randint(0, 100, (2, 5)), mask)
    check_decode(solution, model_for("tiny"), torch.randint(0, 100, (2, 5)), mask)
