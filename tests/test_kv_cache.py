"""KVCache: the memory formula, the errors, and the main claim — at every decode step the logits read
from the cache equal a full recompute of the whole sequence (learned/RoPE, MHA/GQA, padding, backends)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import padded_prompts, small_lm

from mini_transformer import KVCache, TransformerConfig, TransformerLM

VOCAB = 50


def small_model(pos_emb="learned", n_kv_heads=None, backend="naive", max_seq_len=24) -> TransformerLM:
    return small_lm(VOCAB, max_seq_len, pos_emb, n_kv_heads, backend)


def check_cached_equals_recompute(model, idx, mask, n_steps, chunk=1, atol=1e-5):
    """Prefill idx with a cache, then feed `n_steps` random tokens `chunk` at a time; after each step the
    cached logits of the new tokens must equal the full forward pass over everything so far."""
    B, T = idx.shape
    cache = KVCache.for_model(model.config, B, T + n_steps)
    with torch.no_grad():
        prefill_logits, _ = model(idx, attention_mask=mask, cache=cache)
        full_logits, _ = model(idx, attention_mask=mask)
        real = mask.bool()
        torch.testing.assert_close(prefill_logits[real], full_logits[real], rtol=0, atol=atol)
        seq, seq_mask = idx, mask
        for start in range(0, n_steps, chunk):
            new = torch.randint(0, VOCAB, (B, min(chunk, n_steps - start)))
            step_logits, _ = model(new, cache=cache)  # (B, chunk, V)
            seq = torch.cat([seq, new], dim=1)
            seq_mask = torch.cat([seq_mask, torch.ones_like(new)], dim=1)
            full_logits, _ = model(seq, attention_mask=seq_mask)
            torch.testing.assert_close(step_logits, full_logits[:, -new.shape[1]:], rtol=0, atol=atol)
    assert cache.length == seq.shape[1]
    assert cache.next_position.tolist() == seq_mask.sum(dim=1).tolist()


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("n_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_cached_decode_equals_full_recompute_left_padded(pos_emb, n_kv_heads, backend):
    model = small_model(pos_emb, n_kv_heads, backend)
    idx, mask = padded_prompts([0, 3, 6], prompt_len=7, vocab=VOCAB)
    check_cached_equals_recompute(model, idx, mask, n_steps=10)


@pytest.mark.parametrize("pos_emb", ["sinusoidal", "none"])
def test_cached_decode_other_position_schemes(pos_emb):
    idx, mask = padded_prompts([2, 0], prompt_len=5, vocab=VOCAB)
    check_cached_equals_recompute(small_model(pos_emb), idx, mask, n_steps=6)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_chunked_prefill_equals_full_recompute(pos_emb):
    """Several tokens per cached call (chunked prefill / speculative-style steps) follow the same rule."""
    model = small_model(pos_emb, n_kv_heads=2)
    check_cached_equals_recompute(model, *padded_prompts([1, 4], prompt_len=6, vocab=VOCAB), n_steps=12, chunk=4)


@settings(max_examples=8, deadline=None)
@given(
    pad_lengths=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    pos_emb=st.sampled_from(["learned", "rope"]),
    backend=st.sampled_from(["naive", "sdpa"]),
)
def test_cached_decode_random_padding(pad_lengths, pos_emb, backend):
    torch.manual_seed(len(pad_lengths))
    model = small_model(pos_emb, n_kv_heads=2, backend=backend)
    check_cached_equals_recompute(model, *padded_prompts(pad_lengths, prompt_len=6, vocab=VOCAB), n_steps=5)


def test_float64_cache_matches_to_machine_precision():
    model = small_model("rope", n_kv_heads=2).double()
    idx, mask = padded_prompts([0, 2], prompt_len=5, vocab=VOCAB)
    cache = KVCache.for_model(model.config, 2, 12, dtype=torch.float64)
    assert cache.k.dtype == torch.float64
    with torch.no_grad():
        model(idx, attention_mask=mask, cache=cache)
        new = torch.randint(0, VOCAB, (2, 1))
        step, _ = model(new, cache=cache)
        full, _ = model(torch.cat([idx, new], 1), attention_mask=torch.cat([mask, torch.ones_like(new)], 1))
    torch.testing.assert_close(step[:, -1], full[:, -1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("preset", ["gpt2-small", "llama-tiny", "tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nbytes_formula(preset, dtype):
    cfg = TransformerConfig.from_preset(preset)
    B, max_len = 3, 16
    cache = KVCache.for_model(cfg, B, max_len, dtype=dtype)
    element_size = torch.finfo(dtype).bits // 8
    assert cache.nbytes == 2 * cfg.n_layer * B * cfg.n_kv_heads * max_len * cfg.d_head * element_size
    assert cache.k.shape == (cfg.n_layer, B, cfg.n_kv_heads, max_len, cfg.d_head)


def test_gqa_cache_stores_kv_heads_not_query_heads():
    mha = KVCache.for_model(TransformerConfig.from_preset("llama-tiny", n_kv_heads=4), 1, 8)
    gqa = KVCache.for_model(TransformerConfig.from_preset("llama-tiny"), 1, 8)  # n_kv_heads=2 of 4
    assert gqa.nbytes * 2 == mha.nbytes


def test_for_model_defaults_to_max_seq_len_and_rejects_longer():
    cfg = TransformerConfig.from_preset("tiny")
    assert KVCache.for_model(cfg, 1).max_len == cfg.max_seq_len
    with pytest.raises(ValueError, match="max_len=33 exceeds the model's max_seq_len=32"):
        KVCache.for_model(cfg, 1, cfg.max_seq_len + 1)


@pytest.mark.parametrize("field", ["n_layer", "batch_size", "max_len", "n_kv_heads", "d_head"])
@pytest.mark.parametrize("value", [0, -1, 2.0])
def test_constructor_rejects_bad_sizes(field, value):
    sizes = dict(n_layer=2, batch_size=1, max_len=8, n_kv_heads=2, d_head=4)
    sizes[field] = value
    with pytest.raises(ValueError if type(value) is int else TypeError, match=field):  # 2.0: the wrong kind
        KVCache(**sizes)


def test_overflow_raises_before_any_work():
    model = small_model(max_seq_len=24)
    cache = KVCache.for_model(model.config, 1, 6)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 5)), cache=cache)
        k_before, keep_before = cache.k.clone(), cache.key_padding_mask.clone()
        with pytest.raises(ValueError, match=r"cache overflow: 5 cached \+ 2 new tokens > max_len=6"):
            model(torch.randint(0, VOCAB, (1, 2)), cache=cache)
    assert cache.length == 5 and torch.equal(cache.k, k_before) and torch.equal(cache.key_padding_mask, keep_before)


def test_exceeding_max_seq_len_with_cache_raises():
    model = small_model(max_seq_len=8)
    cache = KVCache(2, 1, 16, 4, 8)  # a hand-made cache longer than the model allows
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 8)), cache=cache)
        with pytest.raises(ValueError, match=r"sequence length 9 \(cached 8 \+ new 1\) exceeds max_seq_len=8"):
            model(torch.randint(0, VOCAB, (1, 1)), cache=cache)


@pytest.mark.parametrize(
    "cache_args, message",
    [
        (dict(batch_size=3), "batch size 2 does not match the cache's batch_size=3"),
        (dict(n_kv_heads=2), r"cache has \(n_layer, n_kv_heads, d_head\) = \(2, 2, 8\), expected \(2, 4, 8\)"),
        (dict(dtype=torch.float64), "cache dtype torch.float64 does not match the model's dtype torch.float32"),
    ],
)
def test_mismatched_cache_raises_before_any_work(cache_args, message):
    model = small_model()
    kwargs = dict(n_layer=2, batch_size=2, max_len=8, n_kv_heads=4, d_head=8)
    dtype = cache_args.pop("dtype", torch.float32)
    cache = KVCache(**{**kwargs, **cache_args}, dtype=dtype)
    with pytest.raises(ValueError, match=message), torch.no_grad():
        model(torch.randint(0, VOCAB, (2, 3)), cache=cache)
    assert cache.length == 0 and not cache.key_padding_mask.any()


def test_reset_makes_the_cache_reusable():
    model = small_model("rope", n_kv_heads=2)
    idx, mask = padded_prompts([2, 0], prompt_len=5, vocab=VOCAB)
    cache = KVCache.for_model(model.config, 2, 10)
    with torch.no_grad():
        first, _ = model(idx, attention_mask=mask, cache=cache)
        model(torch.randint(0, VOCAB, (2, 3)), cache=cache)
        cache.reset()
        assert cache.length == 0 and cache.next_position.tolist() == [0, 0]
        again, _ = model(idx, attention_mask=mask, cache=cache)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def mask_handed_to_attention(cache):
    """What `attend` passes the model's attention as key_padding_mask (layer 0, dummy q/k/v)."""
    B, Hkv, D = cache.batch_size, cache.k.shape[2], cache.k.shape[4]
    T = cache.length - cache.start
    k = torch.zeros(B, Hkv, T, D)
    return cache.attend(0, k, k, k, lambda q, k_all, v_all, mask: mask)


def test_begin_positions_count_real_tokens_only():
    cache = KVCache(1, 2, 10, 1, 2)
    keep = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    positions = cache.begin(torch.zeros(2, 4, dtype=torch.long), keep)
    assert mask_handed_to_attention(cache).tolist() == keep.bool().tolist()
    assert positions[:, 2:].tolist() == [[0, 1], [2, 3]] and positions[1].tolist() == [0, 1, 2, 3]
    positions = cache.begin(torch.zeros(2, 1, dtype=torch.long), None)
    assert positions.tolist() == [[2], [4]] and mask_handed_to_attention(cache).shape == (2, 5)
    assert cache.next_position.tolist() == [3, 5]  # begin counts the new tokens at once
    assert (cache.start, cache.length) == (4, 5)


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_unpadded_decode_skips_the_mask_and_still_matches(backend):
    """Without padding the cache hands attention no mask at all (a single query at the end sees every
    key); the logits must not change."""
    model = small_model("rope", n_kv_heads=2, backend=backend)
    idx = torch.randint(0, VOCAB, (2, 5))
    cache = KVCache.for_model(model.config, 2, 12)
    cache.begin(idx, None)
    assert mask_handed_to_attention(cache) is None and not cache.has_padding
    cache.reset()
    check_cached_equals_recompute(model, idx, torch.ones_like(idx), n_steps=6)


def test_one_query_without_mask_equals_naive_in_every_backend():
    from mini_transformer.attention import attention

    q = torch.randn(2, 4, 1, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 7, 8, dtype=torch.float64), torch.randn(2, 2, 7, 8, dtype=torch.float64)
    reference = attention(q, k, v, causal=True, backend="naive")
    torch.testing.assert_close(attention(q, k, v, causal=True, backend="sdpa"), reference)
    full = torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) / 8**0.5, -1)
    torch.testing.assert_close(reference, full @ v.repeat_interleave(2, 1))  # sees all 7 keys


def test_padding_is_remembered_once_seen():
    cache = KVCache(1, 2, 8, 1, 2)
    keep = torch.tensor([[False, True], [True, True]])
    cache.begin(torch.zeros(2, 2, dtype=torch.long), keep)
    assert mask_handed_to_attention(cache) is not None
    cache.begin(torch.zeros(2, 1, dtype=torch.long), None)
    # the old padding stays masked
    assert mask_handed_to_attention(cache).tolist() == [[False, True, True], [True, True, True]]
