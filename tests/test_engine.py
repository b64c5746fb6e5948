"""LLMEngine against generate(): every request's greedy output equals generate() on that prompt alone,
whatever the block size, prefix caching, token budget (chunked prefill), pool size (preemption) and
arrival times. Seeded sampling is batch-independent. Bad requests fail alone, with a clear error."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM, generate
from mini_transformer.engine import EngineConfig, LLMEngine
from mini_transformer.engine.sequence import Sequence

VOCAB = 50


def make_model(style: str) -> TransformerLM:
    extra = dict(pos_emb="rope", n_kv_heads=2, norm="rmsnorm", ffn="swiglu", bias=False) if style == "llama" else {}
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layer=2, d_ff=64, max_seq_len=64,
                            init_std=0.2, **extra)
    torch.manual_seed(0)
    return TransformerLM(cfg).eval()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request):
    return make_model(request.param)


def make_prompts(seed=1):
    """Ragged prompts; two share a 16-token prefix with the second (prefix caching has something to find)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 19, 9, 26, 1, 12)]
    prompts.append(prompts[1][:16] + [3, 4, 5])
    prompts.append(prompts[1][:16])  # a prompt that is entirely cached by then
    return prompts


def alone(model, prompt, max_tokens, **kw):
    return generate(model, torch.tensor([prompt]), max_tokens, **kw)[0].tolist()


@pytest.fixture(scope="module")
def expected(model):
    return [alone(model, p, 10) for p in make_prompts()]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_equals_generate_alone(model, expected, block_size, prefix_caching):
    engine = LLMEngine(model, EngineConfig(block_size=block_size, num_blocks=200, enable_prefix_caching=prefix_caching))
    assert engine.generate(make_prompts(), SamplingParams(max_tokens=10), use_tqdm=False) == expected
    stats = engine.stats()
    assert stats["blocks_in_use"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    assert (stats["prefix_cache_hit_tokens"] > 0) == prefix_caching


def test_chunked_prefill_mixes_chunks_and_decode_tokens(model, expected):
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=200, max_num_batched_tokens=7))
    assert engine.generate(make_prompts(), SamplingParams(max_tokens=10), use_tqdm=False) == expected
    stats = engine.stats()
    assert stats["max_batched_tokens_seen"] <= 7
    assert stats["mixed_steps"] > 0, "no step ran a prefill chunk beside a decode token"


def test_preemption_keeps_outputs(model, expected):
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=12, max_num_batched_tokens=16))
    assert engine.generate(make_prompts(), SamplingParams(max_tokens=10), use_tqdm=False) == expected
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["blocks_in_use"] == 0 and stats["peak_blocks_in_use"] <= 12


def test_requests_added_while_others_run(model, expected):
    prompts = make_prompts()
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=40, max_num_batched_tokens=12, max_num_seqs=3))
    outputs, ids, step = {}, {}, 0
    while len(ids) < len(prompts) or engine.has_unfinished_requests():
        if step % 3 == 0 and len(ids) < len(prompts):  # a new request every third step
            ids[engine.add_request(prompts[len(ids)], SamplingParams(max_tokens=10))] = len(ids)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
        assert step < 500
    assert [outputs[rid] for rid in sorted(ids, key=ids.get)] == expected


def test_seeded_sampling_is_the_same_alone_or_in_a_batch():
    model64 = make_model("llama").double()  # float64: batched and alone logits agree far below sampling noise
    prompts = make_prompts()
    params = [SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=100 + i) for i in range(len(prompts))]
    batch = LLMEngine(model64, EngineConfig(block_size=4, num_blocks=100)).generate(prompts, params, use_tqdm=False)
    for prompt, p, got in zip(prompts, params, batch, strict=True):
        assert got == alone(model64, prompt, p)  # generate() with the same seed
    single = LLMEngine(model64, EngineConfig(block_size=4, num_blocks=100)).generate(prompts[:1], params[:1],
                                                                                   use_tqdm=False)
    assert single[0] == batch[0]


def test_stop_tokens_and_eos_end_a_request(model):
    prompt = make_prompts()[3]
    free_run = alone(model, prompt, 10)
    stop = free_run[4]
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=50), eos_token_id=stop)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=10))
    rid_ignore = engine.add_request(prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    tokens = [t for out in outs[rid] for t in out.new_token_ids]
    assert tokens == free_run[:free_run.index(stop) + 1]
    assert outs[rid][-1].finished and outs[rid][-1].finish_reason == "stop"
    assert [t for out in outs[rid_ignore] for t in out.new_token_ids] == free_run
    assert outs[rid_ignore][-1].finish_reason == "length"
    assert not any(out.finished for out in outs[rid_ignore][:-1])


def test_abort_frees_blocks_at_once(model):
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=50))
    prompts = make_prompts()
    ids = [engine.add_request(p, SamplingParams(max_tokens=20)) for p in prompts[:3]]
    engine.step()
    assert engine.stats()["blocks_in_use"] > 0
    assert engine.abort(ids[1]) and not engine.abort(ids[1]) and not engine.abort("no such id")
    for out in engine.step():
        assert out.request_id != ids[1]
    for rid in (ids[0], ids[2]):
        engine.abort(rid)
    assert engine.stats()["blocks_in_use"] == 0 and not engine.has_unfinished_requests()
    after = engine.generate([prompts[0]], SamplingParams(max_tokens=10), use_tqdm=False)[0]
    assert after == alone(model, prompts[0], 10)


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"),
    ([1, VOCAB], SamplingParams(), "vocab_size"),
    ([1, -1], SamplingParams(), "vocab_size"),
    ([[1, 2]], SamplingParams(), "token ids"),
    ([1] * 60, SamplingParams(max_tokens=10), r"max_seq_len=64; max_tokens <= 4 fits after this prompt"),
    ([1] * 64, SamplingParams(max_tokens=1), r"max_seq_len=64; shorten the prompt"),
    ([1] * 20, SamplingParams(max_tokens=30), "num_blocks"),
    ([1, 2], SamplingParams(stop_token_ids=[VOCAB + 3]), "stop_token_ids"),
])
def test_bad_requests_fail_alone(model, prompt, params, match):
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=10))
    good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == alone(model, [1, 2, 3], 5)
    assert outs[-1].request_id == good and engine.stats()["blocks_in_use"] == 0


def test_bad_engine_arguments(model):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="num_blocks"):
        LLMEngine(model, EngineConfig(num_blocks=0))
    with pytest.raises(ValueError, match="smaller than one block"):
        LLMEngine(model, EngineConfig(block_size=16, kv_cache_bytes=100))
    with pytest.raises(ValueError, match="not both"):
        LLMEngine(model, EngineConfig(num_blocks=4, kv_cache_bytes=10**6))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLMEngine(model, EngineConfig(max_num_batched_tokens=0))
    with pytest.raises(TypeError, match="TransformerLM"):
        LLMEngine("model")
    with pytest.raises(TypeError, match="SamplingParams"):
        LLMEngine(model, EngineConfig(num_blocks=4)).add_request([1], {"max_tokens": 3})
    engine = LLMEngine(model, EngineConfig(block_size=4, kv_cache_bytes=10**5))
    assert engine.stats()["kv_cache_bytes"] <= 10**5 and engine.num_blocks >= 1


def test_triton_backend_walks_the_block_tables_in_its_kernel():
    pytest.importorskip("triton")  # Triton's interpreter here (conftest sets TRITON_INTERPRET=1)
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=32, n_heads=2, n_kv_heads=1, n_layer=1, d_ff=32,
                            max_seq_len=32, pos_emb="rope", init_std=0.2, attn_backend="triton")
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    prompts = make_prompts()[:3]
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=30, max_num_batched_tokens=8))
    got = engine.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    assert got == [alone(model, p, 4) for p in prompts]
    assert engine.stats()["mixed_steps"] > 0
    with pytest.raises(ValueError, match="power of two"):
        LLMEngine(model, EngineConfig(block_size=3, num_blocks=4))


def test_the_cpu_engine_decodes_through_its_paged_attention_object_to_the_kernel(monkeypatch):
    """The runner chooses its paged attention once: for a CPU fp32 pool the C++ kernel where it builds (a
    float64 pool: the compiled reference). Each decode step reaches the kernel in two calls from the
    attention module: MultiHeadAttention.forward -> PagedBatch.attend -> CpuPagedAttention.decode -> the op."""
    import sys

    from mini_transformer.attention import paged
    from mini_transformer.attention.paged_cpu import decode_kernel_available
    from mini_transformer.model.transformer import MultiHeadAttention

    if not decode_kernel_available():
        pytest.skip("the C++ kernel cannot be built here")
    model = make_model("llama")
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=50))
    assert type(engine.runner.attention) is paged.CpuPagedAttention
    calls, kernel = [], torch.ops.mt_paged.decode

    def counted(q, *args):
        frame, hops = sys._getframe(1), []
        while not (frame.f_code.co_name == "forward" and isinstance(frame.f_locals.get("self"), MultiHeadAttention)):
            hops.append(frame.f_code.co_qualname)
            frame = frame.f_back
        calls.append((q.shape[0], hops))
        return kernel(q, *args)

    prompts = make_prompts()[:2]
    with monkeypatch.context() as patch:  # torch.ops itself: only this call may see the counting function
        patch.setattr(torch.ops.mt_paged, "decode", counted)
        outputs = engine.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    assert outputs == [alone(model, p, 4) for p in prompts]
    assert max(rows for rows, _ in calls) == 2  # both sequences' decode rows in one call
    assert {tuple(hops) for _, hops in calls} == {("CpuPagedAttention.decode", "PagedBatch.attend")}
    assert type(LLMEngine(make_model("llama").double(), EngineConfig(block_size=4, num_blocks=50)).runner.attention) \
        is paged.CompiledPagedAttention


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_each_step_builds_its_metadata_once_from_the_persistent_block_table(monkeypatch, backend):
    """One metadata build per step, every layer reads it; the block tables it gets are the rows of the
    runner's persistent BlockTable, equal to each sequence's block list (rows freed when requests end)."""
    from mini_transformer.attention.paged import PagedAttentionMetadata

    if backend == "triton":
        pytest.importorskip("triton")
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=32, n_heads=2, n_layer=2, d_ff=32, max_seq_len=32,
                            attn_backend=backend)
    model = TransformerLM(cfg).eval()
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20, max_num_batched_tokens=6))
    built, build = [], PagedAttentionMetadata.build.__func__

    def spy(cls, tables, *args, **kwargs):
        built.append(len(tables))
        for row, blocks in zip(tables, [list(seq.block_table) for seq, _ in engine._plan], strict=True):
            assert row[:len(blocks)].tolist() == blocks
        return build(cls, tables, *args, **kwargs)

    monkeypatch.setattr(PagedAttentionMetadata, "build", classmethod(spy))
    prompts = make_prompts()[:3]
    steps_before = engine.stats()["steps"]
    original = engine.runner.prepare

    def prepare(scheduled, extra_rows):
        engine._plan = scheduled
        return original(scheduled, extra_rows)

    monkeypatch.setattr(engine.runner, "prepare", prepare)
    assert engine.generate(prompts, SamplingParams(max_tokens=3), use_tqdm=False) == [alone(model, p, 3)
                                                                                        for p in prompts]
    assert len(built) == engine.stats()["steps"] - steps_before  # once per step, not per layer
    assert engine.runner.block_table.row_of == {}  # every finished request gave its row back


def test_a_failing_forward_pass_ends_its_requests_and_leaves_the_engine_usable(model, monkeypatch):
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=50))
    prompt = make_prompts()[3]
    engine.add_request(prompt, SamplingParams(max_tokens=5))

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "execute_model", broken)
        with pytest.raises(RuntimeError, match="device lost"):
            engine.step()
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and stats["blocks_in_use"] == 0 and stats["cached_blocks"] == 0
    assert engine.generate([prompt], SamplingParams(max_tokens=5), use_tqdm=False)[0] == alone(model, prompt, 5)


def test_repetition_penalty_sees_the_whole_sequence(model):
    prompts = make_prompts()[:3]
    params = SamplingParams(max_tokens=10, repetition_penalty=1.8)
    got = LLMEngine(model, EngineConfig(block_size=4, num_blocks=60)).generate(prompts, params, use_tqdm=False)
    assert got == [alone(model, p, params) for p in prompts]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 16]), budget=st.integers(1, 24),
       max_num_seqs=st.integers(1, 4), caching=st.booleans())
def test_random_workloads_equal_generate(data, block_size, budget, max_num_seqs, caching):
    """Random prompts (some sharing a prefix), budgets down to 1 token per step, pools barely larger than
    the biggest request, requests arriving at random steps: every output equals generate() alone."""
    model = make_model("llama")
    base = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
    prompts = [data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)) for _ in range(4)]
    prompts = [base + p if i % 2 else p for i, p in enumerate(prompts)]
    max_tokens = data.draw(st.integers(1, 6))
    biggest = -(-max(len(p) + max_tokens for p in prompts) // block_size)
    engine = LLMEngine(model, EngineConfig(block_size=block_size, num_blocks=biggest + data.draw(st.integers(0, 6)),
                                           max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                           enable_prefix_caching=caching))
    arrivals = sorted(data.draw(st.lists(st.integers(0, 8), min_size=4, max_size=4)))
    ids, outputs, step = {}, {}, 0
    while len(ids) < len(prompts) or engine.has_unfinished_requests():
        while len(ids) < len(prompts) and arrivals[len(ids)] <= step:
            ids[engine.add_request(prompts[len(ids)], SamplingParams(max_tokens=max_tokens))] = len(ids)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
        assert step < 1000
    assert [outputs[rid] for rid in sorted(ids, key=ids.get)] == [alone(model, p, max_tokens) for p in prompts]
    assert engine.stats()["blocks_in_use"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_engine_on_cuda_equals_generate(backend):
    """On a GPU (tools/gpu_check.py runs `pytest -k cuda` with TRITON_INTERPRET=0): the pool, the
    paged attention (gathered for sdpa, the Triton kernel for triton) and sampling all on the device."""
    if backend == "triton":
        pytest.importorskip("triton")
        from mini_transformer.attention.triton_flash import _kernels_are_interpreted

        if _kernels_are_interpreted():
            pytest.skip("TRITON_INTERPRET=1: the kernels would not run on the GPU")
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=64, n_heads=4, n_kv_heads=2, n_layer=2, d_ff=128,
                            max_seq_len=64, pos_emb="rope", norm="rmsnorm", ffn="swiglu", init_std=0.2,
                            attn_backend=backend)
    torch.manual_seed(0)
    model = TransformerLM(cfg).to("cuda").eval()
    prompts = make_prompts()
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=40, max_num_batched_tokens=16))
    got = engine.generate(prompts, SamplingParams(max_tokens=10), use_tqdm=False)
    assert got == [generate(model, torch.tensor([p], device="cuda"), 10)[0].tolist() for p in prompts]
    stats = engine.stats()
    assert stats["mixed_steps"] > 0 and stats["blocks_in_use"] == 0


def test_moe_model_through_the_engine(monkeypatch):
    """An MoE model (Mixtral-style top-2 of 4 experts) runs in the engine unchanged: packed tokens of many
    requests are routed one by one, so every request still equals generate() alone. The layer chooses its
    dispatch as on CUDA (no grouped kernel): the sorted loop over experts for packed steps, the gathered
    path for steps of at most 2 tokens (N*k <= E); both must run."""
    from mini_transformer.model import moe as moe_module

    monkeypatch.setattr(moe_module, "_grouped_mm_fits", lambda x, weight: False)
    paths = {"dispatch": 0, "dispatch_gathered": 0}

    def counting(name, original):
        def counted(*args):
            paths[name] += 1
            return original(*args)
        return counted

    for name in paths:
        monkeypatch.setattr(moe_module, name, counting(name, getattr(moe_module, name)))
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, n_layer=2, d_ff=64,
                            max_seq_len=64, pos_emb="rope", norm="rmsnorm", ffn="moe", n_experts=4,
                            n_experts_per_tok=2, bias=False, init_std=0.2)
    torch.manual_seed(0)
    moe = TransformerLM(cfg).eval()
    prompts = make_prompts()
    engine = LLMEngine(moe, EngineConfig(block_size=4, num_blocks=200, max_num_batched_tokens=16))
    assert engine.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False) == [alone(moe, p, 8) for p in prompts]
    assert engine.stats()["mixed_steps"] > 0 and engine.stats()["blocks_in_use"] == 0
    assert paths["dispatch"] > 0 and paths["dispatch_gathered"] > 0, paths


@pytest.mark.parametrize("prompt_len, output_len", [(1, 0), (3, 0), (1, 3), (4, 2)])
def test_tokens_between_is_the_slice_of_the_whole_token_list(prompt_len, output_len):
    seq = Sequence("r", list(range(prompt_len)), SamplingParams(max_tokens=8), (), arrival=0,
                   device=torch.device("cpu"))
    seq.output_token_ids = list(range(100, 100 + output_len))
    total = prompt_len + output_len
    for start in range(total + 1):
        for end in range(start, total + 2):
            assert seq.tokens_between(start, end) == seq.tokens[start:end], (start, end)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_graph_decode_equals_eager_on_cuda():
    """Decode-only steps replay captured CUDA graphs (padded to a bucket); eager (enforce_eager) must give
    the same tokens, for batch sizes on and between the buckets."""
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=64, n_heads=4, n_kv_heads=2, n_layer=2, d_ff=128,
                            max_seq_len=64, pos_emb="rope", norm="rmsnorm", ffn="swiglu", attn_backend="sdpa")
    torch.manual_seed(0)
    model = TransformerLM(cfg).cuda().eval()
    prompts = make_prompts()[:5]
    params = SamplingParams(max_tokens=6)
    graphs = LLMEngine(model, EngineConfig(block_size=4, num_blocks=100, max_num_seqs=8))
    assert graphs.runner.graphs is not None
    eager = LLMEngine(model, EngineConfig(block_size=4, num_blocks=100, max_num_seqs=8, enforce_eager=True))
    assert eager.runner.graphs is None
    assert graphs.generate(prompts, params, use_tqdm=False) == eager.generate(prompts, params, use_tqdm=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_sampled_engine_step_never_syncs_on_cuda():
    """After the prompts are in, a sampled decode step makes no hidden host<->device sync: the one read of
    the sampled ids is the step's only one (done outside the checked region by read_back's .tolist)."""
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=64, n_heads=4, n_kv_heads=2, n_layer=2, d_ff=128,
                            max_seq_len=64, pos_emb="rope", norm="rmsnorm", ffn="swiglu", attn_backend="sdpa")
    model = TransformerLM(cfg).cuda().eval()
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=100, max_num_seqs=8, enforce_eager=True))
    for prompt in make_prompts()[:3]:
        engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1))
    engine.step()  # the prompts
    scheduled = engine.scheduler.schedule().scheduled
    runner = engine.runner
    with torch.inference_mode():
        idx, positions, rows, meta, _ = runner.prepare(scheduled, [])
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = runner.forward(idx, positions, rows, meta)
            runner.sampler.sample(logits, [seq for seq, _ in scheduled])
        finally:
            torch.cuda.set_sync_debug_mode("default")
