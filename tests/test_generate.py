"""generate(): cached == uncached, padded batch == rows alone, greedy == Hugging Face generate on the
same imported weights, EOS per row, streaming, seeds, and errors raised before any work."""

import pytest
import torch
from support import padded_prompts, small_lm

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM, generate

VOCAB = 60


def small_model(pos_emb="learned", n_kv_heads=None, backend="naive", max_seq_len=40) -> TransformerLM:
    return small_lm(VOCAB, max_seq_len, pos_emb, n_kv_heads, backend)


class ForwardCounter:
    """Counts the model's forward passes: each ends in one call of the head."""

    def __init__(self, model):
        self.calls = 0
        model.lm_head.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.calls += 1


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("pos_emb, n_kv_heads", [("learned", None), ("rope", 2), ("rope", 1)])
def test_greedy_with_cache_equals_without(pos_emb, n_kv_heads, backend):
    model = small_model(pos_emb, n_kv_heads, backend)
    idx, mask = padded_prompts([0, 2, 5], prompt_len=6, vocab=VOCAB, pad_id=0)
    with_cache = generate(model, idx, 16, attention_mask=mask)
    without = generate(model, idx, 16, attention_mask=mask, use_cache=False)
    assert with_cache.shape == (3, 16)
    assert torch.equal(with_cache, without)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_left_padded_batch_equals_each_row_alone(pos_emb):
    model = small_model(pos_emb, n_kv_heads=2)
    idx, mask = padded_prompts([0, 3, 5], prompt_len=6, vocab=VOCAB, pad_id=0)
    batch = generate(model, idx, 12, attention_mask=mask)
    for row in range(3):
        alone = generate(model, idx[row:row + 1, mask[row].argmax():], 12)
        assert torch.equal(batch[row], alone[0]), f"row {row}"


def test_sampling_with_cache_equals_without_for_the_same_seed():
    model = small_model("rope", n_kv_heads=2).double()  # float64: cached and uncached probabilities agree to 1e-15
    idx, mask = padded_prompts([1, 0], prompt_len=5, vocab=VOCAB, pad_id=0)
    kwargs = dict(temperature=1.2, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3, attention_mask=mask)
    a = generate(model, idx, 15, generator=torch.Generator().manual_seed(3), **kwargs)
    b = generate(model, idx, 15, use_cache=False, generator=torch.Generator().manual_seed(3), **kwargs)
    assert torch.equal(a, b)


def test_same_seed_same_sample_other_seed_other_sample():
    model = small_model()
    idx = torch.randint(0, VOCAB, (4, 3))
    draw = [generate(model, idx, 20, temperature=1.0, generator=torch.Generator().manual_seed(s)) for s in (5, 5, 6)]
    assert torch.equal(draw[0], draw[1])
    assert not torch.equal(draw[0], draw[2])


def test_eos_stops_each_row_separately_and_pads_with_eos():
    model = small_model("rope")
    idx, mask = padded_prompts([0, 2, 4], prompt_len=5, vocab=VOCAB, pad_id=0)
    free = generate(model, idx, 20, attention_mask=mask)
    eos = int(free[0, 3])  # a token row 0 produces at step 3 (maybe earlier too; maybe elsewhere in other rows)
    stopped = generate(model, idx, 20, attention_mask=mask, eos_token_id=eos)
    for row in range(3):
        hits = (free[row] == eos).nonzero().flatten().tolist()
        end = hits[0] + 1 if hits else 20
        assert torch.equal(stopped[row, :end], free[row, :end])  # identical up to and including its EOS
        assert (stopped[row, end:] == eos).all()  # then only EOS
    assert (stopped[0] == eos).nonzero()[0].item() <= 3


def test_loop_ends_once_every_row_has_stopped():
    model = small_model()
    idx = torch.randint(0, VOCAB, (1, 4))
    first = int(generate(model, idx, 1)[0, 0])
    steps = []
    counter = ForwardCounter(model)
    out = generate(model, idx, 10, eos_token_id=first, stream=steps.append)
    assert out.tolist() == [[first] * 10]
    # the stop test runs one step late (the host never waits on the device mid-loop): one decode step is
    # queued after everyone stopped, and its logits are dropped unsampled
    assert len(steps) == 1 and counter.calls == 2


def test_stream_receives_each_steps_tokens():
    model = small_model()
    idx, mask = padded_prompts([0, 1], prompt_len=4, vocab=VOCAB, pad_id=0)
    seen = []
    out = generate(model, idx, 7, attention_mask=mask, stream=lambda ids: seen.append(ids.clone()))
    assert len(seen) == 7 and all(s.shape == (2,) for s in seen)
    assert torch.equal(torch.stack(seen, dim=1), out)


def test_prefill_once_then_one_forward_per_token():
    model = small_model()
    counter = ForwardCounter(model)
    generate(model, torch.randint(0, VOCAB, (2, 5)), 8)
    assert counter.calls == 8  # 1 prefill + 7 decode steps (the last token is never fed back)


def test_training_mode_is_restored_and_dropout_is_off():
    cfg = TransformerConfig.from_preset("tiny", vocab_size=VOCAB, attn_pdrop=0.5, resid_pdrop=0.5, embd_pdrop=0.5)
    model = TransformerLM(cfg).train()
    idx = torch.randint(0, VOCAB, (1, 4))
    out = generate(model, idx, 5)
    assert model.training
    assert torch.equal(out, generate(model.eval(), idx, 5))


def test_prompt_plus_new_tokens_beyond_max_seq_len_raises_before_any_work():
    model = small_model(max_seq_len=16)
    counter = ForwardCounter(model)
    with pytest.raises(ValueError, match=r"prompt length 10 \+ max_new_tokens 7 = 17 exceeds max_seq_len=16"):
        generate(model, torch.randint(0, VOCAB, (1, 10)), 7)
    assert counter.calls == 0
    assert generate(model, torch.randint(0, VOCAB, (1, 10)), 6).shape == (1, 6)  # exactly full is fine


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(max_new_tokens=0), ValueError, "max_new_tokens=0 must be a positive integer"),
        (dict(idx=torch.zeros(3, dtype=torch.long)), ValueError, r"idx must be a 2-D int64 or int32 tensor"),
        (dict(idx=torch.zeros(1, 3)), ValueError, r"idx must be a 2-D int64 or int32 tensor"),
        (dict(idx=torch.tensor([[1, VOCAB]])), ValueError, f"token id {VOCAB}, outside"),
        (dict(stop_token_ids=[VOCAB + 1]), ValueError, f"stop_token_ids contains {VOCAB + 1}, expected token ids in"),
        (dict(eos_token_id=1.0), TypeError, "eos_token_id=1.0 must be an int"),
        (dict(max_new_tokens=SamplingParams(max_tokens=2), top_k=3), TypeError, "inside SamplingParams"),
        (dict(topk=3), TypeError, r"unknown keyword arguments \['topk'\]"),
        (dict(attention_mask=torch.tensor([[1, 1, 0]])), ValueError, "pad prompts on the LEFT"),
        (dict(attention_mask=torch.tensor([[1, 0, 1]])), ValueError, "padding after a real token"),
        (dict(attention_mask=torch.tensor([[0, 2, 1]])), ValueError, "only 0 .padding. and 1"),
        (dict(attention_mask=torch.ones(1, 4)), ValueError, r"attention_mask has shape \(1, 4\), expected"),
        (dict(eos_token_id=VOCAB), ValueError, f"eos_token_id={VOCAB} must be a token id in"),
        (dict(temperature=-1.0), ValueError, "temperature=-1.0"),
        (dict(top_p=2.0), ValueError, "top_p=2.0"),
        (dict(top_k=0), ValueError, "top_k=0"),
        (dict(stream="print"), TypeError, "stream must be a callable"),
        (dict(model=torch.nn.Linear(2, 2)), TypeError, "model must be a TransformerLM"),
    ],
)
def test_bad_arguments_raise_before_any_work(kwargs, error, message):
    model = small_model()
    counter = ForwardCounter(model)
    args = dict(model=model, idx=torch.randint(0, VOCAB, (1, 3)), max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        generate(args.pop("model"), args.pop("idx"), args.pop("max_new_tokens"), **args)
    assert counter.calls == 0


# ------------------------------------------------------------------ Hugging Face parity (imported weights)
def hf_gpt2(vocab=VOCAB):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=48, bos_token_id=0,
                     eos_token_id=0, initializer_range=0.2)
    return GPT2LMHeadModel(cfg)


def hf_llama(vocab=VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=0.2)
    return LlamaForCausalLM(cfg)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def hf_pair(request, tmp_path_factory):
    """(HF model, our model loaded from the directory HF saved)."""
    torch.manual_seed(0)
    hf = (hf_gpt2 if request.param == "gpt2" else hf_llama)().eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, TransformerLM.from_pretrained(path)


def hf_greedy(hf, idx, mask, n, **kwargs):
    out = hf.generate(idx, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                      pad_token_id=0, eos_token_id=None, **kwargs)
    return out[:, idx.shape[1]:]


@pytest.mark.parametrize("pad_lengths", [[0], [0, 3, 6]], ids=["one-row", "left-padded"])
def test_greedy_matches_hugging_face_generate(hf_pair, pad_lengths):
    hf, ours = hf_pair
    torch.manual_seed(1)
    idx, mask = padded_prompts(pad_lengths, prompt_len=8, vocab=VOCAB, pad_id=0)
    expected = hf_greedy(hf, idx, mask, 20)
    assert torch.equal(generate(ours, idx, 20, attention_mask=mask), expected)
    assert torch.equal(generate(ours, idx, 20, attention_mask=mask, use_cache=False), expected)


def test_repetition_penalty_matches_hugging_face_generate(hf_pair):
    hf, ours = hf_pair
    torch.manual_seed(2)
    idx = torch.randint(1, VOCAB, (2, 6))
    expected = hf_greedy(hf, idx, torch.ones_like(idx), 15, repetition_penalty=1.5)
    assert torch.equal(generate(ours, idx, 15, repetition_penalty=1.5), expected)


def test_generate_long_slides_the_window_past_the_context():
    from mini_transformer.inference.generate import generate_long

    model = TransformerLM(TransformerConfig.from_preset("tiny", max_seq_len=16)).eval()
    idx = torch.randint(0, 100, (2, 5))
    new = generate_long(model, idx, 30)  # greedy
    assert new.shape == (2, 30)
    assert torch.equal(new[:, :11], generate(model, idx, 11))  # the first chunk fills the context
    window = torch.cat([idx, new[:, :11]], dim=1)[:, -8:]  # then half the context is kept and re-prefilled
    assert torch.equal(new[:, 11:19], generate(model, window, 8))
    fits = generate_long(model, idx, 6)
    assert torch.equal(fits, generate(model, idx, 6))


def test_generate_long_rejects_bad_arguments():
    from mini_transformer.inference.generate import generate_long

    model = TransformerLM(TransformerConfig.from_preset("tiny", max_seq_len=16)).eval()
    idx = torch.randint(0, 100, (1, 5))
    with pytest.raises(ValueError, match="keep_tokens=16"):
        generate_long(model, idx, 4, keep_tokens=16)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        generate_long(model, idx, 0)
    with pytest.raises(ValueError, match="attention_mask"):
        generate_long(model, idx, 4, attention_mask=torch.ones(1, 5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9,
                                                                     repetition_penalty=1.2)])
def test_decode_steps_never_wait_for_the_gpu(params):
    """The decode loop's pieces (sample, one cached step) never read a device value back to the host."""
    from mini_transformer.inference.decoders import decode_step, prefill
    from mini_transformer.inference.kv_cache import KVCache
    from mini_transformer.inference.sampling import sample_next

    model = small_model().cuda()
    idx = torch.randint(0, VOCAB, (2, 5), device="cuda")
    cache = KVCache.for_model(model.config, 2, 16, device="cuda")
    generator = torch.Generator("cuda").manual_seed(0)
    with torch.inference_mode():
        logits = prefill(model, idx, cache, None)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(8):
                next_ids = sample_next(logits, params, previous_ids=idx, generator=generator)
                logits = decode_step(model, next_ids, cache)
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_generate_long_keeps_a_stopped_row_stopped_in_later_chunks():
    """Row 0 stops in the first chunk, row 1 runs on through three more: row 0 must repeat its stop token
    to the end instead of generating again after the window slides."""
    from mini_transformer.inference.generate import generate_long

    torch.manual_seed(1)
    model = TransformerLM(TransformerConfig.from_preset("tiny", max_seq_len=16, vocab_size=20)).eval()
    idx = torch.randint(0, 20, (2, 4))
    first = generate(model, idx[:1], 3)[0].tolist()
    eos = first[2]
    row1_alone = generate_long(model, idx[1:], 30)[0].tolist()
    assert eos not in first[:2] and eos not in row1_alone  # the setup: only row 0 ever stops
    out = generate_long(model, idx, 30, eos_token_id=eos)
    assert out[0].tolist() == first + [eos] * 27
    assert out[1].tolist() == row1_alone


@pytest.mark.parametrize("compiled", [False, True])
def test_each_decoder_gives_the_recompute_decoder_s_logits(compiled):
    """The decoders behind generate's one loop answer prefill / step alike: a cached one (eager KVCache, or
    the compiled StaticCache step) gives the no-cache reference's logits, step after step, padding included."""
    from mini_transformer.inference.decoders import CachedDecoder, RecomputeDecoder
    from mini_transformer.inference.static_cache import CompiledDecoder

    torch.manual_seed(0)
    model = small_model("rope", n_kv_heads=2, backend="sdpa").eval()
    idx, mask = padded_prompts([0, 2], prompt_len=5, vocab=VOCAB, pad_id=0)
    cached = (CompiledDecoder if compiled else CachedDecoder)(model, 2, 5 + 6, torch.device("cpu"))
    reference = RecomputeDecoder(model)
    with torch.inference_mode():
        got, want = cached.prefill(idx, mask), reference.prefill(idx, mask)
        for _ in range(6):
            assert got.shape == want.shape == (2, VOCAB)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            token = want.argmax(-1)  # (B,)
            got, want = cached.step(token), reference.step(token)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if compiled:  # on the CPU the steps after the first replay the recorded graph, without dynamo
        assert cached.replay is not None and cached.replay.graph is not None
