"""Paged attention vs the contiguous attention(): each sequence's keys scattered over random blocks of a
pool, its queries a suffix of its keys (decode, prefill chunk, prefix-cache hit) or all of them."""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_transformer.attention import PagedAttention, PagedAttentionMetadata, attention, get_backend, write_kv
from mini_transformer.attention.paged import CompiledPagedAttention, paged_decode_attention


def scatter_sequences(context_lens, query_lens, block_size, H, Hkv, D, dtype, seed=0):
    """Random q/k/v per sequence, the keys placed in the blocks of a shuffled block table (the reference
    placement walks the table token by token). Returns the per-sequence tensors, the packed batch and
    the pool with the cached (non-new) keys already written."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(need) + 3  # a few blocks nobody owns
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in need:
        tables.append(order[start:start + n])
        start += n
    k_cache = torch.randn(num_blocks * block_size, Hkv, D, generator=gen, dtype=dtype)  # garbage in unused slots
    v_cache = torch.randn(num_blocks * block_size, Hkv, D, generator=gen, dtype=dtype)
    seqs, new_q, new_k, new_v = [], [], [], []
    for table, n_keys, n_new in zip(tables, context_lens, query_lens, strict=True):
        q = torch.randn(H, n_new, D, generator=gen, dtype=dtype)
        k = torch.randn(Hkv, n_keys, D, generator=gen, dtype=dtype)
        v = torch.randn(Hkv, n_keys, D, generator=gen, dtype=dtype)
        for p in range(n_keys - n_new):  # the cached part is in the pool already
            slot = table[p // block_size] * block_size + p % block_size
            k_cache[slot], v_cache[slot] = k[:, p], v[:, p]
        seqs.append((q, k, v))
        new_q.append(q.transpose(0, 1))  # (n_new, H, D)
        new_k.append(k[:, n_keys - n_new:].transpose(0, 1))  # (n_new, Hkv, D)
        new_v.append(v[:, n_keys - n_new:].transpose(0, 1))
    packed = torch.cat(new_q), torch.cat(new_k), torch.cat(new_v)
    return tables, seqs, packed, k_cache, v_cache


def paged(backend, q, k_cache, v_cache, meta, attend=None):
    """What the engine's PagedBatch.attend does with the pool: decode for a decode-only step, else prefill."""
    if meta.is_decode_only:
        return backend.decode(q, k_cache, v_cache, meta)
    return backend.prefill(q, k_cache, v_cache, meta, attend)


def run_paged(context_lens, query_lens, block_size, H, Hkv, D, dtype, attend=None, seed=0, backend=None):
    tables, seqs, (q, k, v), k_cache, v_cache = scatter_sequences(
        context_lens, query_lens, block_size, H, Hkv, D, dtype, seed)
    meta = PagedAttentionMetadata.build(tables, context_lens, query_lens, block_size)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = paged(backend or PagedAttention(), q, k_cache, v_cache, meta, attend)  # (N, H, D)
    return out, seqs, tables, k_cache


def contiguous(seqs, dtype):
    """Each sequence alone through attention(): (N, H, D) packed like the paged output."""
    outs = [attention(q[None].to(dtype), k[None].to(dtype), v[None].to(dtype), causal=True)[0].transpose(0, 1)
            for q, k, v in seqs]
    return torch.cat(outs)


CASES = [  # (context_lens, query_lens): whole prompts, decode steps, suffixes (chunks / prefix hits), mixed
    ([5, 9, 1], [5, 9, 1]),
    ([7, 20, 3, 12], [1, 1, 1, 1]),
    ([17, 8, 33], [4, 8, 16]),
    ([40, 6, 1, 19], [1, 6, 1, 5]),
]


@pytest.mark.parametrize("context_lens, query_lens", CASES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("H, Hkv", [(4, 4), (4, 2), (4, 1)])
def test_paged_equals_contiguous(context_lens, query_lens, block_size, H, Hkv):
    out64, seqs, _, _ = run_paged(context_lens, query_lens, block_size, H, Hkv, 8, torch.float64)
    torch.testing.assert_close(out64, contiguous(seqs, torch.float64), atol=1e-12, rtol=0)
    out32, seqs32, _, _ = run_paged(context_lens, query_lens, block_size, H, Hkv, 8, torch.float32)
    reference = contiguous(seqs32, torch.float32)
    assert (out32 - reference).abs().max() <= 1e-6
    assert (out32.double() - contiguous(seqs32, torch.float64)).abs().max() <= 1e-5


def test_write_kv_puts_each_token_in_the_slot_its_block_table_names():
    context_lens, query_lens, block_size = [9, 4], [3, 4], 4
    _, seqs, tables, k_cache = run_paged(context_lens, query_lens, block_size, 2, 2, 4, torch.float64)
    for table, (_, k, _) in zip(tables, seqs, strict=True):
        for p in range(k.shape[1]):  # walk the block table token by token
            assert torch.equal(k_cache[table[p // block_size] * block_size + p % block_size], k[:, p])


@pytest.mark.parametrize("backend", ["sdpa", "tiled"])
def test_other_backends_through_paged(backend):
    fn = get_backend(backend)

    def attend(q, k, v, mask):
        return fn(q, k, v, causal=True, key_padding_mask=mask, dropout_p=0.0, scale=1 / math.sqrt(q.shape[-1]))

    out, seqs, _, _ = run_paged([13, 2, 30], [13, 1, 7], 4, 4, 2, 8, torch.float32, attend=attend)
    assert (out - contiguous(seqs, torch.float32)).abs().max() <= 1e-5


@settings(max_examples=25, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 3, 8]), groups=st.sampled_from([1, 2, 4]))
def test_paged_equals_contiguous_random_shapes(data, block_size, groups):
    n_seqs = data.draw(st.integers(1, 5))
    context_lens = data.draw(st.lists(st.integers(1, 24), min_size=n_seqs, max_size=n_seqs))
    query_lens = [data.draw(st.integers(1, n)) for n in context_lens]
    out, seqs, _, _ = run_paged(context_lens, query_lens, block_size, 4, 4 // groups, 4, torch.float64)
    torch.testing.assert_close(out, contiguous(seqs, torch.float64), atol=1e-12, rtol=0)


def test_compiled_decode_equals_contiguous():
    """The compiled decode path (the engine's on the CPU where the C++ kernel cannot be built): one compile
    serves every batch size and table width (they are dynamic), decode-only steps and decode rows beside
    prefill rows alike."""
    for context_lens, query_lens in ([7, 20, 3, 12], [1, 1, 1, 1]), ([40, 6, 1, 19, 2], [1, 6, 1, 5, 1]), \
            ([33, 9], [1, 1]):
        out, seqs, _, _ = run_paged(context_lens, query_lens, 4, 4, 2, 8, torch.float32,
                                    backend=CompiledPagedAttention())
        assert (out - contiguous(seqs, torch.float32)).abs().max() <= 1e-6


def test_decode_reads_only_each_sequences_own_blocks():
    """Poison every slot a decode row must not see (other sequences' blocks, its last block's tail): the
    output is unchanged, so the -inf mask and the block-table walk hold."""
    context_lens, query_lens, block_size = [5, 9, 2], [1, 1, 1], 4
    tables, seqs, (q, k, v), k_cache, v_cache = scatter_sequences(context_lens, query_lens, block_size, 4, 2, 8,
                                                                 torch.float64)
    meta = PagedAttentionMetadata.build(tables, context_lens, query_lens, block_size)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    seen = {t[p // block_size] * block_size + p % block_size for t, n in zip(tables, context_lens, strict=True)
            for p in range(n)}
    unseen = torch.tensor(sorted(set(range(k_cache.shape[0])) - seen))
    before = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, block_size, 8 ** -0.5)
    k_cache[unseen], v_cache[unseen] = 1e4, -1e4  # large: any weight leaking onto them would show
    after = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, block_size, 8 ** -0.5)
    assert torch.equal(before, after)
    torch.testing.assert_close(after, contiguous(seqs, torch.float64), atol=1e-12, rtol=0)


def test_metadata_has_the_varlen_fields():
    """slot_mapping walked token by token; query_start_loc the running sum of query lengths; block tables
    padded with block 0; a numpy table (the engine's persistent BlockTable rows) gives the same."""
    context_lens, query_lens, block_size = [17, 8, 33, 1, 5], [4, 8, 1, 1, 1], 4
    tables, *_ = scatter_sequences(context_lens, query_lens, block_size, 2, 1, 4, torch.float32)
    meta = PagedAttentionMetadata.build(tables, context_lens, query_lens, block_size)
    walked = [t[p // block_size] * block_size + p % block_size
              for t, n_keys, n_new in zip(tables, context_lens, query_lens, strict=True)
              for p in range(n_keys - n_new, n_keys)]  # the slot of each new token, token by token
    assert meta.slot_mapping.tolist() == walked
    assert meta.query_start_loc.tolist() == [0, 4, 12, 13, 14, 15]
    assert meta.context_lens.tolist() == context_lens
    assert [row[:len(t)] for row, t in zip(meta.block_tables.tolist(), tables, strict=True)] == tables
    assert all(x == 0 for row, t in zip(meta.block_tables.tolist(), tables, strict=True) for x in row[len(t):])
    wide = np.zeros((5, 20), dtype=np.int64)
    for row, t in zip(wide, tables, strict=True):
        row[:len(t)] = t
    from_array = PagedAttentionMetadata.build(wide, context_lens, query_lens, block_size)
    for name in ("slot_mapping", "block_tables", "context_lens", "query_start_loc"):
        assert torch.equal(getattr(from_array, name), getattr(meta, name)), name


def run_triton(context_lens, query_lens, block_size, H, Hkv, D):
    from mini_transformer.attention.triton_paged import triton_paged_attention

    tables, seqs, (q, k, v), k_cache, v_cache = scatter_sequences(
        context_lens, query_lens, block_size, H, Hkv, D, torch.float32)
    meta = PagedAttentionMetadata.build(tables, context_lens, query_lens, block_size)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = triton_paged_attention(q, k_cache, v_cache, meta)
    return out, seqs


@pytest.mark.parametrize("context_lens, query_lens, block_size, H, Hkv, D", [
    ([5, 3, 1], [5, 1, 1], 1, 2, 2, 4),  # whole prompts and decode steps, one token per block
    ([17, 8, 33], [4, 8, 16], 4, 4, 2, 8),  # suffix queries (prefill chunks, prefix hits), GQA
    ([20, 6, 1], [1, 6, 1], 16, 4, 1, 6),  # MQA, a head size that is not a power of two
])
def test_triton_kernel_reading_the_block_table_equals_contiguous(context_lens, query_lens, block_size, H, Hkv, D):
    pytest.importorskip("triton")  # runs in Triton's interpreter here (conftest sets TRITON_INTERPRET=1)
    out, seqs = run_triton(context_lens, query_lens, block_size, H, Hkv, D)
    assert (out - contiguous(seqs, torch.float32)).abs().max() <= 1e-6


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from mini_transformer.attention import triton_paged as tp

target = GPUTarget("cuda", 90, 32)
backend = triton.compiler.make_backend(target)
kernel = tp._paged_kernel
for ty, block_size, head_dim in (("fp16", 16, 64), ("fp32", 1, 128), ("bf16", 4, 32)):
    consts = dict(BLOCK_SIZE=block_size, BLOCK_D=head_dim)
    pointers = dict(BLOCK_TABLES="*i64", CONTEXT_LENS="*i64", QUERY_START_LOC="*i64")
    sig = {n: "constexpr" if n in consts else pointers.get(n, "*" + ty) if n.isupper()
           else "fp32" if n == "scale" else "i32" for n in kernel.arg_names}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts)
    options = backend.parse_options(dict(num_warps=4, num_stages=1))
    triton.compile(src, target=target, options=options.__dict__)
print("compiled")
"""


def test_triton_paged_kernel_compiles_for_a_gpu(tmp_path):
    """The interpreter never runs the Triton compiler: compile the kernel for sm_90 (no GPU needed), so
    that GPU-only errors (a loop bound read from memory, scalar types in the loop) fail here."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr.lower():
        pytest.skip("this triton install has no ptxas to compile with")
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_triton_kernel_on_cuda_equals_contiguous(dtype, tolerance):
    pytest.importorskip("triton")
    from mini_transformer.attention.triton_flash import _kernels_are_interpreted
    from mini_transformer.attention.triton_paged import triton_paged_attention

    if _kernels_are_interpreted():
        pytest.skip("TRITON_INTERPRET=1: the kernel would not run on the GPU")
    context_lens, query_lens, block_size = [300, 17, 1, 64], [1, 17, 1, 20], 16
    tables, seqs, (q, k, v), k_cache, v_cache = scatter_sequences(
        context_lens, query_lens, block_size, 8, 2, 64, torch.float32)
    meta = PagedAttentionMetadata.build(tables, context_lens, query_lens, block_size, "cuda")
    to = dict(device="cuda", dtype=dtype)
    k_cache, v_cache = k_cache.to(**to), v_cache.to(**to)
    write_kv(k_cache, v_cache, k.to(**to), v.to(**to), meta.slot_mapping)
    out = triton_paged_attention(q.to(**to), k_cache, v_cache, meta)
    reference = contiguous([(a.to(dtype).double(), b.to(dtype).double(), c.to(dtype).double()) for a, b, c in seqs],
                           torch.float64)
    assert (out.double().cpu() - reference).abs().max() <= tolerance
    gathered = PagedAttention().prefill(q.to(**to), k_cache, v_cache, meta)
    assert (gathered.double().cpu() - reference).abs().max() <= tolerance


FALLBACK = """
import torch
from mini_transformer.attention.paged import CompiledPagedAttention, PagedAttention, paged_attention_for
assert type(paged_attention_for("cpu", torch.float32)) is CompiledPagedAttention
assert type(paged_attention_for("cpu", torch.float32, enforce_eager=True)) is PagedAttention
print("fallback")
"""


def test_without_the_cpp_kernel_the_engine_decodes_through_the_compiled_reference():
    """MINI_TRANSFORMER_NATIVE_KERNELS=0 (as where no compiler is found): the CPU decode path is the reference,
    compiled, or eager under enforce_eager."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, MINI_TRANSFORMER_NATIVE_KERNELS="0",
               PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "fallback" in done.stdout, done.stderr[-2000:]
