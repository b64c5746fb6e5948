"""StaticCache and compiled decode: every step's logits equal KVCache's (eager, float64, padding, RoPE,
GQA); generate(compile=True) gives the eager path's tokens, padded batches included; and dynamo compiles
the decode step once — no recompilation over 200 steps, nor for a second batch of the same shapes.

The compiling tests share one shape (B=2, prompt 5, 200 new tokens, tiny model) so that the whole file
pays for one compilation (tens of seconds on 2 busy cores)."""

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import padded_prompts, small_lm

from mini_transformer import KVCache, TransformerConfig, TransformerLM, generate
from mini_transformer.attention import one_query_cpu
from mini_transformer.inference import cpu_decode
from mini_transformer.inference.cpu_decode import _one_query_attention, _one_row_addmm, _one_row_mm
from mini_transformer.inference.static_cache import StaticCache, compiled_decode_step
from mini_transformer.model import float_gemv

VOCAB = 40


def small_model(pos_emb="learned", n_kv_heads=None, backend="naive", max_seq_len=32, dtype=torch.float64):
    return small_lm(VOCAB, max_seq_len, pos_emb, n_kv_heads, backend).to(dtype)


@settings(max_examples=12, deadline=None)
@given(
    pads=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    prompt_len=st.integers(1, 6),
    n_steps=st.integers(1, 8),
    spare=st.integers(0, 5),
    pos_emb=st.sampled_from(["learned", "rope"]),
    n_kv_heads=st.sampled_from([None, 2, 1]),
    backend=st.sampled_from(["naive", "sdpa"]),
)
def test_static_cache_logits_equal_kv_cache(pads, prompt_len, n_steps, spare, pos_emb, n_kv_heads, backend):
    """Eager, float64: prefill + n_steps single-token steps, StaticCache (fixed slabs with `spare`
    never-written slots at the end) against KVCache, step by step."""
    pads = [min(p, prompt_len - 1) for p in pads]  # every row ends with a real token
    model = small_model(pos_emb, n_kv_heads, backend)
    idx, mask = padded_prompts(pads, prompt_len, vocab=VOCAB)
    B = idx.shape[0]
    max_len = prompt_len + n_steps + spare
    static = StaticCache.for_model(model.config, B, max_len, dtype=torch.float64)
    dynamic = KVCache.for_model(model.config, B, max_len, dtype=torch.float64)
    with torch.no_grad():
        got = model.logits(idx, attention_mask=mask, cache=static)
        want, _ = model(idx, attention_mask=mask, cache=dynamic)
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-12)
        for _ in range(n_steps):
            token = torch.randint(0, VOCAB, (B, 1))
            got = model.logits(token, cache=static)
            want, _ = model(token, cache=dynamic)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert static.input_pos.tolist() == [prompt_len + n_steps]
    assert static.next_position.tolist() == dynamic.next_position.tolist()


def test_single_token_prompt_goes_through_the_static_step():
    model = small_model()
    idx = torch.randint(0, VOCAB, (2, 1))
    static = StaticCache.for_model(model.config, 2, 6, dtype=torch.float64)
    dynamic = KVCache.for_model(model.config, 2, 6, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(4):
            got = model.logits(idx, cache=static)
            want, _ = model(idx, cache=dynamic)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_reset_reuses_the_slabs():
    model = small_model()
    idx, mask = padded_prompts([2, 0], 4, vocab=VOCAB)
    cache = StaticCache.for_model(model.config, 2, 8, dtype=torch.float64)
    k_storage = cache.k[0].data_ptr()
    with torch.no_grad():
        first = model.logits(idx, attention_mask=mask, cache=cache)
        cache.reset()
        again = model.logits(idx, attention_mask=mask, cache=cache)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert cache.k[0].data_ptr() == k_storage


def test_static_cache_door_errors():
    cfg = small_model().config
    with pytest.raises(ValueError, match="max_len=99 exceeds"):
        StaticCache.for_model(cfg, 1, 99)
    with pytest.raises(ValueError, match="batch_size=0"):
        StaticCache(2, 0, 8, 4, 8)


@pytest.mark.parametrize("field", ["n_layer", "batch_size", "max_len", "n_kv_heads", "d_head"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_both_caches_share_one_size_check_and_for_model(field, value):
    """StaticCache and KVCache (the reference) refuse the same sizes with the same message, and for_model
    gives them the same slabs: one (B, Hkv, max_len, D) per layer and kind."""
    sizes = dict(n_layer=2, batch_size=1, max_len=8, n_kv_heads=2, d_head=4)
    messages = []
    error = ValueError if type(value) is int else TypeError  # _checks: a float or a bool is the wrong kind
    for cache_class in (KVCache, StaticCache):
        with pytest.raises(error, match=field) as err:
            cache_class(**{**sizes, field: value})
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    cfg = small_model(n_kv_heads=2).config
    static, dynamic = StaticCache.for_model(cfg, 3, 16), KVCache.for_model(cfg, 3, 16)
    assert type(static) is StaticCache and type(dynamic) is KVCache
    assert [tuple(k.shape) for k in static.k] == [tuple(k.shape) for k in dynamic.k] == [(3, 2, 16, 8)] * 2
    assert static.nbytes == dynamic.nbytes
    assert StaticCache.for_model(cfg, 1).max_len == KVCache.for_model(cfg, 1).max_len == cfg.max_seq_len


def test_generate_compile_door_errors():
    model = small_model(dtype=torch.float32)
    idx = torch.randint(0, VOCAB, (1, 3))
    with pytest.raises(ValueError, match="use_cache=False"):
        generate(model, idx, 2, compile=True, use_cache=False)
    with pytest.raises(TypeError, match="compile='yes'"):
        generate(model, idx, 2, compile="yes")


# ------------------------------------------------------------------ compiled (one shape, one compilation)
N_NEW = 200


@pytest.fixture(scope="module")
def compiled_setup():
    torch.manual_seed(0)
    return small_model("rope", n_kv_heads=2, backend="sdpa", max_seq_len=256, dtype=torch.float32)


def graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compiled_decode_compiles_once_and_matches_eager(compiled_setup):
    """200 decode steps of a padded batch: the tokens equal the eager path's, and the whole run (and a
    second batch of the same shapes) adds exactly one graph — the first step's — with no recompilation."""
    model = compiled_setup
    idx, mask = padded_prompts([3, 0], 5, vocab=VOCAB)
    before = graphs_compiled()
    recompiles_before = torch._dynamo.utils.counters["recompiles"].total()
    got = generate(model, idx, N_NEW, attention_mask=mask, compile=True)
    assert graphs_compiled() - before <= 1  # 0 if an earlier test in this process compiled these shapes
    after_first = graphs_compiled()
    want = generate(model, idx, N_NEW, attention_mask=mask)
    assert torch.equal(got, want)

    other, other_mask = padded_prompts([0, 4], 5, vocab=VOCAB)  # new values, same shapes: the same graph runs
    got = generate(model, other, N_NEW, attention_mask=other_mask, compile=True)
    assert torch.equal(got, generate(model, other, N_NEW, attention_mask=other_mask))
    assert graphs_compiled() == after_first
    assert torch._dynamo.utils.counters["recompiles"].total() == recompiles_before


def test_a_cache_marked_static_is_made_once_and_reset_for_each_call(monkeypatch):
    """On cuda the cache's tensors are marked static: the step's CUDA graph replays their addresses, and a
    new address makes cudagraph trees record the graph again (past 128 such records in a process it gives
    CUDA graphs up for the step). A fresh cache per generate() call did that on every call. Emulated on the
    CPU with the marking switched on: three calls of one shape make ONE cache, and each call (padded,
    padded otherwise, unpadded) still gives the eager tokens, so the reset between calls is complete."""
    from mini_transformer.inference import static_cache

    monkeypatch.setattr(static_cache, "marks_static_addresses", lambda device: True)
    monkeypatch.setattr(static_cache, "_SHARED_CACHES", {}, raising=False)
    made = []
    make = StaticCache.__init__
    monkeypatch.setattr(StaticCache, "__init__", lambda self, *args, **kw: made.append(self) or make(self, *args, **kw))
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=VOCAB, d_model=40, n_heads=2, n_layer=1, d_ff=40,
                                            max_seq_len=16)).eval()
    for pads in ([2, 0], [0, 1], [0, 0]):
        idx, mask = padded_prompts(pads, 4, vocab=VOCAB)
        want = generate(model, idx, 6, attention_mask=mask)
        assert torch.equal(generate(model, idx, 6, attention_mask=mask, compile=True), want)
    assert len(made) == 1


def test_compiled_padding_does_not_change_a_row(compiled_setup):
    """A row's tokens are the same alone (no padding) and left-padded inside a batch, compiled."""
    model = compiled_setup
    idx, mask = padded_prompts([3, 0], 5, vocab=VOCAB)
    alone = generate(model, idx[:1, 3:], 20)  # the padded row's 2 real tokens, unpadded, eager
    batch = generate(model, idx, N_NEW, attention_mask=mask, compile=True)
    assert torch.equal(batch[:1, :20], alone)


@settings(max_examples=10, deadline=None)
@given(k=st.integers(1, 70), n=st.integers(1, 70), rows=st.integers(1, 3),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
def test_one_row_matmuls_become_a_reduction_with_aten_s_numbers(k, n, rows, dtype):
    """The CPU decode backend's decompositions: one row -> multiply + sum, equal to float64 addmm / mm
    within the rounding of the dtype's one final result (16-bit inputs are summed in fp32, rounded once);
    more rows -> NotImplemented (aten's kernel), except fp32/bf16/fp16 where the C++ GEMV (float_gemv.py)
    built: up to 8 rows go to it, with the same bound."""
    x, w, b = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype)
    got_addmm, got_mm = _one_row_addmm(b, x, w.t()), _one_row_mm(x, w.t())
    if rows != 1 and not float_gemv.kernel_available(dtype):
        assert got_addmm is NotImplemented and got_mm is NotImplemented
        return
    want = x.double() @ w.double().t()  # (rows, N)
    assert got_mm.dtype == got_addmm.dtype == dtype
    # the float sum's own error: at most ~k + 1 unit roundings of the sum of |terms| (the bias is a term;
    # 16-bit inputs are summed in fp32 too), then the one final rounding to the dtype
    unit = {torch.float64: 2 ** -52}.get(dtype, 2 ** -23)
    rounding = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}.get(dtype, 0.0)  # half an ulp of the result
    magnitude = x.double().abs() @ w.double().abs().t()  # (rows, N) sum of |x w|
    for got, exact, terms in ((got_mm, want, magnitude), (got_addmm, want + b.double(), magnitude + b.double().abs())):
        assert bool(((got.double() - exact).abs() <= terms * (k + 1) * unit + rounding * exact.abs() + 1e-30).all())
    assert _one_row_addmm(b, x, w.t(), beta=2) is NotImplemented


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 2), heads=st.sampled_from([(4, 4), (4, 2), (4, 1)]), Tk=st.integers(1, 40),
       mask_kind=st.sampled_from([None, "bool", "float"]), scale=st.sampled_from([None, 0.3]))
def test_one_query_attention_equals_sdpa(B, heads, Tk, mask_kind, scale):
    """The decomposition of aten's CPU flash attention for one query, float64, against F.sdpa (GQA by
    enable_gqa; a bool mask, or the additive float mask sdpa turns it into); every row keeps a key."""
    H, Hkv = heads
    q, k, v = torch.randn(B, H, 1, 8).double(), torch.randn(B, Hkv, Tk, 8).double(), torch.randn(B, Hkv, Tk, 8).double()
    keep = torch.rand(B, 1, 1, Tk) < 0.7
    keep[..., -1] = True
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
    mask = {None: None, "bool": keep, "float": additive}[mask_kind]
    out, lse = _one_query_attention(q, k, v, attn_mask=mask, scale=scale)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=H != Hkv)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    assert lse.shape == (B, H, 1)
    assert _one_query_attention(q.expand(B, H, 2, 8), k, v) is NotImplemented  # two queries: aten's kernel


def test_compiled_bf16_decode_runs_reductions_and_matches_float64():
    """A bf16 model through generate(compile=True): no aten matmul left in the step (the one-row
    decompositions take 16-bit inputs, summing in fp32), each step's logits within bf16 rounding of the
    same weights run in float64, and the greedy tokens equal the float64 model's."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=48, n_heads=4, n_kv_heads=2, n_layer=2, d_ff=96,
                            max_seq_len=64, pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False,
                            tie_weights=False, attn_backend="sdpa", init_std=0.3)
    model = TransformerLM(cfg).eval().to(torch.bfloat16)
    exact = copy.deepcopy(model).double()  # the same (bf16-rounded) weights, computed in float64
    idx = torch.randint(0, VOCAB, (1, 5))
    got, code = run_and_get_code(generate, model, idx, 30, compile=True)
    assert code, "the bf16 step was not compiled here"
    assert not any(call in c for c in code for call in ("extern_kernels.addmm(", "extern_kernels.mm("))
    assert torch.equal(got, generate(exact, idx, 30))
    cache = StaticCache.for_model(cfg, 1, 64, dtype=torch.bfloat16)
    ref_cache = KVCache.for_model(cfg, 1, 64, dtype=torch.float64)
    with torch.inference_mode():
        model.logits(idx, cache=cache)
        exact.logits(idx, cache=ref_cache)
        step = compiled_decode_step("cpu")
        for token in got[0, :8]:
            logits = step(model, token[None], cache)
            want = exact.logits(token[None, None], cache=ref_cache)[:, -1]
            torch.testing.assert_close(logits.double(), want, rtol=0.05, atol=0.05 * float(want.abs().max()))


def test_compiled_batch_of_one_runs_no_aten_matmul_or_flash_attention(compiled_setup):
    """Batch 1 (the bandwidth-bound case): the compiled step's C++ has no aten matmul or flash-attention
    call left - each matmul is the C++ GEMV (float_gemv.py) and the attention the C++ one-query kernel
    where they build, else inductor's fused multiply-and-sum - and its 200 greedy tokens equal eager's."""
    from torch._inductor.utils import run_and_get_code

    model = compiled_setup
    idx = torch.randint(0, VOCAB, (1, 5))
    got, code = run_and_get_code(generate, model, idx, N_NEW, compile=True)
    assert code, "the batch-1 step was not compiled here"
    calls = ("extern_kernels.addmm(", "extern_kernels.mm(", "_scaled_dot_product_flash_attention_for_cpu.default(")
    for aten_kernel in calls:  # calls, not the "Original ATen" comments that name the ops they replace
        assert not any(aten_kernel in c for c in code), aten_kernel
    gemv = float_gemv.kernel_available(torch.float32)
    assert any("mt_float.gemv" in c for c in code) == gemv
    # fp32 attention: the C++ kernel only beside the GEMV op (without it, one fused inductor step)
    assert any("mt_one_query" in c for c in code) == (gemv and one_query_cpu.kernel_available())
    assert torch.equal(got, generate(model, idx, N_NEW))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_query_kernel_equals_the_decomposition(dtype, monkeypatch):
    """One-query attention goes to the C++ kernel (where it builds; fp32 only beside the C++ GEMV): the
    decomposition it replaces (its reference) gives the same output within one rounding and logsumexp,
    with the static cache's mask (a written prefix, bool or sdpa's additive form, batch 1 or B)."""
    if not one_query_cpu.kernel_available():
        pytest.skip("the C++ kernel cannot be built here")
    if dtype == torch.float32 and not float_gemv.kernel_available(dtype):
        pytest.skip("fp32 attention stays in inductor's fused step where the fp32 GEMV is not built")
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape).to(dtype) for shape in ((2, 6, 1, 24), (2, 2, 50, 24), (2, 2, 50, 24)))
    keep = torch.arange(50) < torch.tensor([17, 50]).reshape(2, 1, 1, 1)  # (2, 1, 1, 50)
    for mask in (None, keep, keep[:1], torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))):
        calls = []

        def counted(*args, calls=calls):
            calls.append(1)
            return torch.ops.mt_one_query.attend(*args)

        monkeypatch.setattr(one_query_cpu, "one_query_kernel", counted)
        out, lse = _one_query_attention(q, k, v, attn_mask=mask, scale=0.3)
        monkeypatch.setattr(cpu_decode, "_one_query_kernel_takes", lambda *a: False)
        want, want_lse = _one_query_attention(q, k, v, attn_mask=mask, scale=0.3)
        monkeypatch.undo()
        assert calls == [1] and out.dtype == want.dtype == dtype and lse.dtype == want_lse.dtype == torch.float32
        bound = {torch.float32: 1e-6}.get(dtype, torch.finfo(dtype).eps)
        assert ((out.float() - want.float()).abs() <= bound * (1 + want.float().abs())).all()
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-5)


def test_without_the_kernel_the_compiled_step_runs_the_decomposition(monkeypatch):
    """Where the C++ kernel is not built (MINI_TRANSFORMER_NATIVE_KERNELS=0, no compiler), the compiled step has no
    mt_one_query call and still gives eager's greedy tokens (a layout no other test compiles: d_model 36)."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(one_query_cpu, "kernel_available", lambda: False)
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=36, n_heads=6, n_kv_heads=2, n_layer=2, d_ff=48, max_seq_len=48,
                            pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False, attn_backend="sdpa")
    model = TransformerLM(cfg).eval()
    idx = torch.randint(0, VOCAB, (1, 4))
    got, code = run_and_get_code(generate, model, idx, 20, compile=True)
    assert code and not any("mt_one_query" in c for c in code)
    assert torch.equal(got, generate(model, idx, 20))


def test_decode_decompositions_pickle_by_name():
    """The table enters inductor's FX-graph cache key pickled: as a call of decode_decompositions (a few
    bytes naming it), where inductor's own entries would not pickle, and it loads back as the same table."""
    import pickle

    table = cpu_decode.decode_decompositions()
    data = pickle.dumps(table)
    assert b"decode_decompositions" in data and len(data) < 200
    assert pickle.loads(data).keys() == table.keys()
    assert table[torch.ops.aten.mm.default] is _one_row_mm


def test_cpu_decode_backend_settings_stay_inside_its_compile():
    """The backend's options (AOT cache off, the int8 stored-input threshold, the one-row
    decompositions) belong to the decode step's compile alone: after an int8 compiled decode, inductor's
    and functorch's global settings and inductor's decomposition table are what they were, and a plain
    torch.compile of a one-row linear in the same process still calls aten's addmm (training with
    compile=True, HF's compiled forward and user code get inductor as it was)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.utils import run_and_get_code

    from mini_transformer.model.quantize import quantize

    before = (inductor_config.get_config_copy(), functorch_config.get_config_copy(), dict(select_decomp_table()))
    torch.manual_seed(0)  # a layout no other test compiles (d_model 24), so this call compiles here
    cfg = TransformerConfig(vocab_size=VOCAB, d_model=24, n_heads=2, n_layer=1, d_ff=48, max_seq_len=16)
    model = quantize(TransformerLM(cfg).eval(), "int8")
    cache_counts = torch._dynamo.utils.counters["inductor"]
    bypassed, looked_up = cache_counts["fxgraph_cache_bypass"], cache_counts["fxgraph_cache_miss"] + cache_counts[
        "fxgraph_cache_hit"]
    _, code = run_and_get_code(generate, model, torch.randint(0, VOCAB, (1, 3)), 3, compile=True)
    assert code, "the int8 decode step was not compiled here"
    after = (inductor_config.get_config_copy(), functorch_config.get_config_copy(), dict(select_decomp_table()))
    assert after == before
    assert torch._inductor.compile_fx.select_decomp_table is select_decomp_table  # put back after the compile
    # the FX-graph cache was consulted (its key could be built), not bypassed
    assert cache_counts["fxgraph_cache_bypass"] == bypassed
    assert cache_counts["fxgraph_cache_miss"] + cache_counts["fxgraph_cache_hit"] > looked_up

    weight, bias = torch.randn(40, 32), torch.randn(40)
    plain = torch.compile(lambda x: torch.nn.functional.linear(x, weight, bias), fullgraph=True, dynamic=False)
    _, code = run_and_get_code(plain, torch.randn(1, 32))
    assert any("extern_kernels.addmm(" in c for c in code), "a plain compile got the decode backend's GEMV"


def test_sample_cli_compile_flag_reaches_generate(tmp_path, capsys, monkeypatch):
    """`sample --compile` asks the decode loop for compile=True (the compiled path itself is tested above)."""
    import importlib

    from mini_transformer.cli import main
    from mini_transformer.tokenizer import CharTokenizer

    tokenizer = CharTokenizer.train("abc def")
    model = TransformerLM(small_model(dtype=torch.float32).config.replace(vocab_size=tokenizer.vocab_size))
    model.save_pretrained(tmp_path)
    tokenizer.save(tmp_path)
    generate_module = importlib.import_module("mini_transformer.inference.generate")  # the module, not the function
    seen = []
    real_decode = generate_module.decode

    def spy(model, idx, params, options):
        seen.append(options.compile)
        return real_decode(model, idx, params, dataclasses.replace(options, compile=False))

    monkeypatch.setattr(generate_module, "decode", spy)
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "abc", "--max-new-tokens", "5",
                 "--compile"]) == 0
    assert seen == [True]
