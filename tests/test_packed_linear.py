"""PackedLinear (model/packed_linear.py) against F.linear in float64: the same map up to float rounding,
at 1 and 2 threads, whatever the rows; a changed weight is packed again; training, other dtypes and
copies take the plain path or pack anew; the engine's greedy tokens equal those of `aten::mm`."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import on_threads

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM
from mini_transformer.engine import EngineConfig, LLMEngine
from mini_transformer.model.packed_linear import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this PyTorch build has no oneDNN linear ops")


def packed(in_features, out_features, bias=True, seed=0):
    torch.manual_seed(seed)
    return PackedLinear.from_linear(nn.Linear(in_features, out_features, bias=bias))


def within_rounding(y, x, layer):
    """|y - x W^T - b| within a few float32 ulps of the sum of |terms| (any summation order meets it)."""
    bias = None if layer.bias is None else layer.bias.double()
    ref = F.linear(x.double(), layer.weight.double(), bias)
    scale = x.double().abs() @ layer.weight.double().abs().T + (0 if bias is None else bias.abs()) + 1e-30
    return ((y.double() - ref).abs() <= 8 * (layer.in_features + 1) * 2**-24 * scale).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 70), in_features=st.integers(1, 200), out_features=st.integers(1, 150),
       bias=st.booleans(), threads=st.sampled_from([1, 2]))
def test_packed_linear_is_the_linear_map(rows, in_features, out_features, bias, threads):
    layer = packed(in_features, out_features, bias)
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        y = on_threads(threads, layer, x)
    assert y.shape == (rows, out_features) and layer._packed is not None  # it took the packed path
    assert within_rounding(y, x, layer)


def test_leading_dimensions_are_kept():
    layer = packed(24, 40)
    x = torch.randn(2, 7, 24)
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (2, 7, 40)
    assert within_rounding(y.reshape(14, 40), x.reshape(14, 24), layer)


def test_a_changed_weight_is_packed_again():
    layer, other = packed(32, 48, seed=0), packed(32, 48, seed=1)
    x = torch.randn(5, 32)
    with torch.inference_mode():
        layer(x)
    first = layer._packed
    with torch.no_grad():
        layer.load_state_dict(other.state_dict())  # in place: the weight's version moves on
    with torch.inference_mode():
        y = layer(x)
    assert layer._packed is not first and within_rounding(y, x, other)
    layer.weight = nn.Parameter(torch.zeros(48, 32))  # a new tensor
    with torch.inference_mode():
        assert torch.equal(layer(x), layer.bias.detach().expand(5, 48))


def test_training_and_other_dtypes_take_the_plain_linear():
    layer = packed(16, 8)
    plain = nn.Linear(16, 8)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).sum().backward()
    assert layer._packed is None and layer.weight.grad is not None
    plain(x).sum().backward()
    assert torch.equal(layer.weight.grad, plain.weight.grad)
    with torch.inference_mode():
        half = copy.deepcopy(layer).to(torch.bfloat16)
        assert torch.equal(half(x.detach().bfloat16()), F.linear(x.detach().bfloat16(), half.weight, half.bias))
        assert half._packed is None


def test_copies_and_state_dict_are_those_of_a_linear():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    keys = list(model.state_dict())
    pack_linears(model)
    assert all(isinstance(model[i], PackedLinear) for i in (0, 2)) and list(model.state_dict()) == keys
    x = torch.randn(2, 8)
    with torch.inference_mode():
        y = model(x)
        twin = copy.deepcopy(model)  # the oneDNN tensor is not copied: the twin packs its own
        assert twin[0]._packed is None and torch.equal(twin(x), y)


def test_the_engine_gives_the_tokens_of_aten_mm():
    cfg = TransformerConfig(vocab_size=300, d_model=64, n_heads=4, n_kv_heads=2, n_layer=2, d_ff=128,
                            max_seq_len=96, pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False, init_std=0.2)
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    plain = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (3, 40, 17, 1, 29)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ours = LLMEngine(model, EngineConfig(num_blocks=64)).generate(prompts, params, use_tqdm=False)
    mm = LLMEngine(plain, EngineConfig(num_blocks=64, pack_linear_weights=False)).generate(prompts, params,
                                                                                          use_tqdm=False)
    assert isinstance(model.lm_head, PackedLinear) and type(plain.lm_head) is nn.Linear
    assert ours == mm
