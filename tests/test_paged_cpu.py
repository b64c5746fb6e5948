"""The C++ paged decode kernel (attention/paged_cpu.py) vs contiguous attention() and vs the PyTorch
reference paged_decode_attention: GQA, ragged lengths, lengths that are not a multiple of the block
size, block sizes 1 and 16, shuffled block tables, one sequence, head sizes with and without a tail
past the 16-float vector loop; bf16/fp16 pools vs the reference computing in fp32."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import on_threads
from test_paged_attention import contiguous, paged, scatter_sequences

from mini_transformer.attention.paged import (
    PagedAttentionMetadata,
    paged_attention_for,
    paged_decode_attention,
    write_kv,
)
from mini_transformer.attention.paged_cpu import decode_kernel_available, paged_decode_kernel

pytestmark = pytest.mark.skipif(not decode_kernel_available(), reason="the C++ kernel cannot be built here")


def decode_setup(context_lens, block_size, H, Hkv, D, dtype=torch.float32, seed=0):
    """One decode query per sequence, its keys in the shuffled blocks of a pool: (q, pools, metadata, seqs)."""
    query_lens = [1] * len(context_lens)
    tables, seqs, (q, k, v), k_cache, v_cache = scatter_sequences(context_lens, query_lens, block_size, H, Hkv, D,
                                                                 dtype, seed)
    meta = PagedAttentionMetadata.build(tables, context_lens, query_lens, block_size)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return q, k_cache, v_cache, meta, seqs


def kernel(q, k_cache, v_cache, meta):
    return paged_decode_kernel(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.block_size,
                               1 / math.sqrt(q.shape[-1]))


@pytest.mark.parametrize("context_lens", [[1], [37], [7, 20, 3, 12], [16, 32, 17, 1, 48]])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("H, Hkv, D", [(4, 4, 8), (4, 2, 64), (6, 2, 64), (4, 1, 24), (2, 1, 40)])
def test_kernel_equals_contiguous(threads, context_lens, block_size, H, Hkv, D):
    q, k_cache, v_cache, meta, seqs = decode_setup(context_lens, block_size, H, Hkv, D)
    out = kernel(q, k_cache, v_cache, meta)  # (S, H, D)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert (out - contiguous(seqs, torch.float32)).abs().max() <= 1e-6
    assert (out.double() - contiguous(seqs, torch.float64)).abs().max() <= 1e-6


# `threads` (the torch thread count) holds for every example
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), block_size=st.sampled_from([1, 2, 3, 16]), groups=st.sampled_from([1, 2, 3]),
       D=st.sampled_from([4, 16, 19, 32]))
def test_kernel_equals_reference_random_shapes(threads, data, block_size, groups, D):
    n_seqs = data.draw(st.integers(1, 6))
    context_lens = data.draw(st.lists(st.integers(1, 70), min_size=n_seqs, max_size=n_seqs))
    Hkv = data.draw(st.integers(1, 3))
    q, k_cache, v_cache, meta, seqs = decode_setup(context_lens, block_size, Hkv * groups, Hkv, D,
                                                   seed=data.draw(st.integers(0, 99)))
    out = kernel(q, k_cache, v_cache, meta)
    reference = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, block_size,
                                       1 / math.sqrt(D))
    assert (out - reference).abs().max() <= 1e-6
    assert (out.double() - contiguous(seqs, torch.float64)).abs().max() <= 1e-6


def test_kernel_reads_only_each_sequences_own_keys(threads):
    """Poison every slot a sequence must not see (others' blocks, the tail of its last block, the table's
    padding entries): the kernel's output does not change by a single bit."""
    context_lens, block_size = [5, 9, 2, 30], 4
    q, k_cache, v_cache, meta, _ = decode_setup(context_lens, block_size, 4, 2, 32)
    before = kernel(q, k_cache, v_cache, meta)
    tables = meta.block_tables.tolist()
    seen = {t[p // block_size] * block_size + p % block_size for t, n in zip(tables, context_lens, strict=True)
            for p in range(n)}
    unseen = torch.tensor(sorted(set(range(k_cache.shape[0])) - seen))
    k_cache[unseen], v_cache[unseen] = float("nan"), float("nan")
    assert torch.equal(kernel(q, k_cache, v_cache, meta), before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_pools_compute_in_fp32_like_the_reference(threads, dtype):
    """bf16/fp16 pools are widened to fp32 as they load and the result rounded once: equal to the
    reference (which promotes to fp32) up to that one rounding, and far closer to float64 than bf16 sums."""
    q, k_cache, v_cache, meta, _ = decode_setup([40, 3, 17, 64, 1], 16, 6, 2, 64, dtype=dtype)
    out = kernel(q, k_cache, v_cache, meta)
    assert out.dtype == dtype
    reference = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 16, 1 / 8)
    exact = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), meta.block_tables,
                                   meta.context_lens, 16, 1 / 8)  # the same inputs, float64 arithmetic
    one_rounding = torch.finfo(dtype).eps * exact.abs() + 1e-6  # an fp32 result rounded once to dtype
    assert ((out.double() - exact).abs() <= one_rounding).all()
    assert ((out.double() - reference.double()).abs() <= 2 * one_rounding).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens", [[70], [7, 20, 3, 12]])  # 1 sequence: a task per (sequence, kv head)
def test_kernel_same_bits_on_1_and_2_threads(dtype, context_lens):
    """Fewer sequences than threads split over kv heads, more split over sequences; either way each head is
    walked alone in one order, so 1 and 2 threads give the same bits."""
    q, k_cache, v_cache, meta, _ = decode_setup(context_lens, 16, 6, 3, 64, dtype=dtype)
    args = (q, k_cache, v_cache, meta)
    assert torch.equal(on_threads(1, kernel, *args), on_threads(2, kernel, *args))


def test_kernel_on_strided_queries():
    """The engine hands a transposed view of the packed queries (from (1, H, N, D)): same result."""
    q, k_cache, v_cache, meta, _ = decode_setup([9, 21, 4], 4, 4, 2, 32)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, (N, H, D) with H outermost
    assert not strided.is_contiguous()
    assert torch.equal(kernel(strided, k_cache, v_cache, meta), kernel(q, k_cache, v_cache, meta))


def test_engine_decode_path_uses_the_kernel_in_mixed_steps():
    """paged_attention_for("cpu", dtype): decode-only steps and decode rows beside prefill rows equal
    contiguous attention; float64 pools still go through the reference."""
    for dtype, bound in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        backend = paged_attention_for("cpu", dtype)
        for context_lens, query_lens in (([7, 20, 3, 12], [1, 1, 1, 1]), ([40, 6, 1, 19, 2], [1, 6, 1, 5, 1])):
            tables, seqs, (q, k, v), k_cache, v_cache = scatter_sequences(context_lens, query_lens, 4, 4, 2, 16,
                                                                         dtype)
            meta = PagedAttentionMetadata.build(tables, context_lens, query_lens, 4)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            out = paged(backend, q, k_cache, v_cache, meta)
            assert (out - contiguous(seqs, dtype)).abs().max() <= bound


@pytest.mark.parametrize("sharpness", [4.0, 16.0])
def test_kernel_with_peaked_scores(sharpness):
    """Scores spread over tens of units (a peaked softmax: the running max jumps, weights underflow): the
    kernel's vectorised exp and its rescaling stay as close to float64 as the fp32 reference does (fp32
    scores of size ~30 carry rounding errors ~1e-6 themselves, so the bound grows with the sharpness)."""
    q, k_cache, v_cache, meta, _ = decode_setup([300, 45, 17, 1, 128], 16, 6, 2, 64)
    q = q * sharpness
    args = (meta.block_tables, meta.context_lens, 16, 1 / 8)
    exact = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), *args)
    reference_error = (paged_decode_attention(q, k_cache, v_cache, *args).double() - exact).abs().max()
    kernel_error = (kernel(q, k_cache, v_cache, meta).double() - exact).abs().max()
    assert kernel_error <= max(1.5 * reference_error, 1e-6) and kernel_error <= 1e-6 * sharpness


def test_the_cpu_engine_decodes_through_the_kernel(monkeypatch):
    """LLMEngine on the CPU runs its decode rows through the kernel (decode-only steps and, with a budget
    of 7 tokens, decode rows beside prefill chunks), and its greedy output equals generate() alone."""
    from mini_transformer import SamplingParams, TransformerConfig, TransformerLM, generate
    from mini_transformer.engine import EngineConfig, LLMEngine

    calls, kernel = [], torch.ops.mt_paged.decode

    def counted(q, *args):
        calls.append(q.shape[0])
        return kernel(q, *args)

    cfg = TransformerConfig(vocab_size=50, d_model=64, n_heads=4, n_kv_heads=2, n_layer=2, d_ff=64, max_seq_len=64,
                            pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False, init_std=0.2)
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 50, (n,), generator=gen).tolist() for n in (5, 19, 9, 26, 1)]
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=100, max_num_batched_tokens=7))
    with monkeypatch.context() as patch:  # torch.ops itself: only the engine's run sees the counting function
        patch.setattr(torch.ops.mt_paged, "decode", counted)
        outputs = engine.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    assert outputs == [generate(model, torch.tensor([p]), 8)[0].tolist() for p in prompts]
    assert engine.stats()["mixed_steps"] > 0 and max(calls) > 1  # several sequences in one call

