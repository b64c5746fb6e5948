"""Norms, feed-forward networks and grouped-query attention, each against a float64 formula or an
explicit reference (k/v heads repeated with repeat_interleave)."""

import math

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_transformer import TransformerConfig, TransformerLM
from mini_transformer.attention import attention, causal_mask
from mini_transformer.config import llama_ffn_size
from mini_transformer.model.cache import NoCache
from mini_transformer.model.layers import MLP, RMSNorm, SwiGLU
from mini_transformer.model.transformer import make_ffn, make_norm

C = 16


def with_random_params(module: nn.Module) -> nn.Module:
    """Norm weights off 1 and biases off 0, so a formula that forgets one of them fails."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module


# ---- norms ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rmsnorm_matches_float64_formula(eps):
    norm = with_random_params(RMSNorm(C, eps=eps))
    x = torch.randn(3, 5, C) * 3
    x64, w64 = x.double(), norm.weight.double()
    expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-5, atol=1e-6)


def test_rmsnorm_keeps_bf16_dtype():
    norm = with_random_params(RMSNorm(C))
    x = torch.randn(4, C) * 100
    expected = (x / x.pow(2).mean(-1, keepdim=True).sqrt()) * norm.weight.detach()
    out = norm(x.bfloat16())  # float32 weight, bf16 activation (mixed precision)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    assert norm.to(torch.bfloat16)(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_with_and_without_bias(bias):
    cfg = TransformerConfig(d_model=C, n_heads=2, norm="layernorm", norm_eps=1e-5, bias=bias)
    norm = with_random_params(make_norm(cfg))
    assert (norm.bias is not None) == bias
    x = torch.randn(3, 5, C).double()
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * norm.weight.double()
    if bias:
        expected = expected + norm.bias.double()
    torch.testing.assert_close(norm(x.float()).double(), expected, rtol=1e-5, atol=1e-5)


def test_make_norm_chooses_rmsnorm():
    norm = make_norm(TransformerConfig(d_model=C, n_heads=2, norm="rmsnorm", norm_eps=1e-3))
    assert isinstance(norm, RMSNorm) and norm.eps == 1e-3
    assert [name for name, _ in norm.named_parameters()] == ["weight"]  # no bias, no centring


# ---- feed-forward ---------------------------------------------------------------------------------

ACTIVATIONS = {
    "gelu": lambda a: 0.5 * a * (1 + torch.erf(a / math.sqrt(2))),
    "gelu_tanh": lambda a: 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3))),
    "relu": lambda a: a.clamp(min=0),
}


@pytest.mark.parametrize("ffn", list(ACTIVATIONS))
def test_mlp_activations_match_formulas(ffn):
    cfg = TransformerConfig(d_model=C, n_heads=2, d_ff=40, ffn=ffn)
    mlp = with_random_params(make_ffn(cfg)).double()
    assert isinstance(mlp, MLP)
    x = torch.randn(2, 7, C, dtype=torch.float64)
    expected = ACTIVATIONS[ffn](x @ mlp.fc1.weight.T + mlp.fc1.bias) @ mlp.fc2.weight.T + mlp.fc2.bias
    torch.testing.assert_close(mlp(x), expected)


def test_gelu_forms_are_close_but_not_equal():
    a = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    gap = (ACTIVATIONS["gelu"](a) - ACTIVATIONS["gelu_tanh"](a)).abs().max()
    assert 1e-6 < gap < 1e-3
    assert not torch.allclose(ACTIVATIONS["gelu"](a), ACTIVATIONS["relu"](a))


@pytest.mark.parametrize("bias", [True, False])
def test_swiglu_matches_formula(bias):
    cfg = TransformerConfig(d_model=C, n_heads=2, d_ff=24, ffn="swiglu", bias=bias)
    ffn = with_random_params(make_ffn(cfg)).double()
    assert isinstance(ffn, SwiGLU) and (ffn.w_up.bias is not None) == bias
    x = torch.randn(2, 7, C, dtype=torch.float64)

    def linear(layer, t):
        return t @ layer.weight.T + (layer.bias if bias else 0)

    gate = linear(ffn.w_gate, x)
    expected = linear(ffn.w_down, gate * torch.sigmoid(gate) * linear(ffn.w_up, x))  # silu(a) = a * sigmoid(a)
    torch.testing.assert_close(ffn(x), expected)


@pytest.mark.parametrize("d_model, multiple_of, expected", [(4096, 256, 11008), (64, 32, 192), (384, 64, 1024)])
def test_llama_sizing_rule(d_model, multiple_of, expected):
    assert llama_ffn_size(d_model, multiple_of) == expected
    assert expected % multiple_of == 0 and expected - multiple_of < 8 * d_model / 3 <= expected  # rounded up once
    cfg = TransformerConfig(d_model=d_model, n_heads=1, ffn="swiglu", ffn_multiple_of=multiple_of)
    assert cfg.d_ff == expected
    # three matrices of width 8/3*d cost what two of width 4*d cost, up to that rounding
    swiglu, gelu = 3 * d_model * cfg.d_ff, 2 * d_model * 4 * d_model
    assert gelu <= swiglu < gelu + 3 * d_model * multiple_of


# ---- grouped-query attention ----------------------------------------------------------------------


def repeated_kv_attention(q, k, v, keep=None):
    """Reference: copy each k/v head G times (repeat_interleave, like HF repeat_kv) and run plain
    multi-head attention in float64."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, H, Tk, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    mask = causal_mask(q.shape[2], k.shape[2])[None, None]
    if keep is not None:
        mask = mask & keep[:, None, None, :]
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)
    return weights @ v


@settings(max_examples=15, deadline=None)
@given(heads=st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 3), (6, 2)]), T=st.integers(1, 9),
       backend=st.sampled_from(["naive", "sdpa"]), pad=st.integers(0, 3))
def test_attention_gqa_equals_repeated_kv(heads, T, backend, pad):
    H, Hkv = heads
    q = torch.randn(2, H, T, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, Hkv, T, 8, dtype=torch.float64)
    keep = torch.ones(2, T, dtype=torch.bool)
    keep[1, :min(pad, T)] = False  # left padding on the second row
    out = attention(q, k, v, causal=True, key_padding_mask=keep, backend=backend)
    torch.testing.assert_close(out, repeated_kv_attention(q, k, v, keep))


def attention_reference(block_attn, x, n_heads, n_kv_heads):
    """Our MultiHeadAttention module recomputed by hand with repeated k/v heads (no RoPE: pos_emb='none')."""
    B, T, _ = x.shape
    D = block_attn.d_head
    qkv = x @ block_attn.W_qkv.weight.T + block_attn.W_qkv.bias  # (B, T, (H + 2*Hkv) * D)
    q, k, v = qkv.split([n_heads * D, n_kv_heads * D, n_kv_heads * D], dim=-1)
    q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in (q, k, v))  # (B, heads, T, D)
    out = repeated_kv_attention(q, k, v).transpose(1, 2).reshape(B, T, -1)
    return out @ block_attn.W_o.weight.T + block_attn.W_o.bias


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_gqa_module_equals_repeated_kv_reference(backend, n_kv_heads):
    cfg = TransformerConfig.from_preset("tiny", n_kv_heads=n_kv_heads, pos_emb="none", attn_backend=backend)
    attn = with_random_params(TransformerLM(cfg).blocks[0].attn).double()
    H, D = cfg.n_heads, cfg.d_head
    assert attn.W_qkv.weight.shape == ((H + 2 * n_kv_heads) * D, cfg.d_model)
    x = torch.randn(2, 11, cfg.d_model, dtype=torch.float64)
    torch.testing.assert_close(attn(x, NoCache()), attention_reference(attn, x, H, n_kv_heads))


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_gqa_model_equals_mha_model_with_repeated_kv_rows(backend, n_kv_heads):
    """A GQA model is an MHA model whose k/v projection rows are copied per group: load the copies
    into an MHA model and the logits (RoPE, padding and all) agree."""
    gqa_cfg = TransformerConfig.from_preset("llama-tiny", n_kv_heads=n_kv_heads, attn_backend=backend)
    gqa = TransformerLM(gqa_cfg).eval()
    mha = TransformerLM(gqa_cfg.replace(n_kv_heads=gqa_cfg.n_heads)).eval()
    H, D, G = gqa_cfg.n_heads, gqa_cfg.d_head, gqa_cfg.n_heads // n_kv_heads
    state = dict(gqa.state_dict())
    for i in range(gqa_cfg.n_layer):
        w = state[f"blocks.{i}.attn.W_qkv.weight"]
        q, k, v = w.split([H * D, n_kv_heads * D, n_kv_heads * D])
        k, v = (t.view(n_kv_heads, D, -1).repeat_interleave(G, dim=0).reshape(H * D, -1) for t in (k, v))
        state[f"blocks.{i}.attn.W_qkv.weight"] = torch.cat([q, k, v])
    mha.load_state_dict(state)
    ids = torch.randint(0, gqa_cfg.vocab_size, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :5] = 0
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids, attention_mask=mask)[0], mha(ids, attention_mask=mask)[0])
    saved_per_layer = 2 * (H - n_kv_heads) * D * gqa_cfg.d_model  # fewer k and v rows
    assert gqa.num_parameters() == mha.num_parameters() - gqa_cfg.n_layer * saved_per_layer


def test_n_kv_heads_must_divide_n_heads():
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=4"):
        TransformerConfig.from_preset("tiny", n_kv_heads=3)
