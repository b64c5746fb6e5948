"""Weight-only quantization: each quantized linear against its float64 reference within the bound its
scales imply (rounding moves a weight by at most half a step), the packed kernels against
dequantize-then-matmul, quantize() on a whole model in place, and safetensors save/load round trips."""

import json

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from mini_transformer import TransformerConfig, TransformerLM, generate
from mini_transformer.checkpoint import CheckpointError
from mini_transformer.model.quantize import (
    Int4Linear,
    Int8Linear,
    int4_rowwise,
    int8_rowwise,
    pack_nibbles,
    quantize,
    unpack_nibbles,
)


def rounding_bound(x: torch.Tensor, step: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(M, N) bound on |x w^T - x w_hat^T|: sum_k |x_k| * step[n, k] / 2, plus float32 matmul slack.
    step (N, K) is the quantization step of each weight."""
    x64 = x.double().abs()
    rounding = x64 @ (step.double() / 2).T
    float_slack = 1e-5 * (x64 @ weight.double().abs().T) + 1e-6
    return rounding + float_slack


def check_within_bound(layer, linear, x, step):
    want = x.double() @ linear.weight.double().T + linear.bias.double()  # the float layer, in float64
    got = layer(x).double()
    bound = rounding_bound(x, step, linear.weight)
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() / bound).max())


@settings(max_examples=10, deadline=None)
@given(in_features=st.integers(1, 80), out_features=st.integers(1, 40), rows=st.integers(1, 4),
       weight_scale=st.floats(1e-3, 10.0))
def test_int8_linear_within_its_scale_bound(in_features, out_features, rows, weight_scale):
    linear = nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.mul_(weight_scale)
    layer = Int8Linear.from_linear(linear)
    step = layer.scales[:, None].expand(out_features, in_features)  # one step per output channel
    check_within_bound(layer, linear, torch.randn(rows, in_features), step)
    assert layer.weight.dtype == torch.int8 and int(layer.weight.abs().max()) <= 127


@settings(max_examples=10, deadline=None)
@given(groups=st.integers(1, 4), group_size=st.sampled_from([16, 32, 64]), out_features=st.sampled_from([5, 16, 48]),
       rows=st.integers(1, 3))
def test_int4_linear_within_its_group_scale_bound(groups, group_size, out_features, rows):
    in_features = groups * group_size
    linear = nn.Linear(in_features, out_features)
    layer = Int4Linear.from_linear(linear, group_size)
    scale = layer.scales_and_zeros[..., 0].T  # (N, G)
    step = scale.repeat_interleave(group_size, dim=1)  # (N, K): each weight's group step
    check_within_bound(layer, linear, torch.randn(rows, in_features), step)


def test_int8_kernel_equals_dequantize_then_matmul():
    linear = nn.Linear(96, 48)
    layer = Int8Linear.from_linear(linear)
    layer.use_kernel = True  # aten._weight_int8pack_mm (runs on this CPU build; opt-in because it is slow)
    x = torch.randn(2, 3, 96)
    want = x.double() @ layer.dequantize().double().T + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_features", [32, 40])  # 40: padded to 48 rows for the kernel, cut back
def test_int4_kernel_equals_dequantize_then_matmul(out_features):
    layer = Int4Linear.from_linear(nn.Linear(128, out_features), group_size=32, use_kernel=True)
    assert layer.kernel_weight is not None
    x = torch.randn(2, 3, 128)
    with_kernel = layer(x)
    layer.kernel_weight = None  # force the fallback
    fallback = layer(x)
    torch.testing.assert_close(with_kernel, fallback, rtol=1e-5, atol=1e-5)


def test_fused_rowwise_forms_equal_dequantize_then_matmul():
    """The multiply-and-sum forms a compiled decode step uses, run eagerly here against float64."""
    x = torch.randn(3, 128)
    int8 = Int8Linear.from_linear(nn.Linear(128, 24))
    want = x.double() @ int8.dequantize().double().T
    torch.testing.assert_close(int8_rowwise(x, int8.weight, int8.scales).double(), want, rtol=1e-5, atol=1e-5)
    int4 = Int4Linear.from_linear(nn.Linear(128, 24), group_size=32)
    want = x.double() @ int4.dequantize().double().T
    got = int4_rowwise(x, int4.weight, int4.scales_and_zeros, 32).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_quantized_linears_take_the_fused_path():
    """Under torch.compile a one-row input goes through the fused reduction; same numbers as eager."""
    a = Int8Linear.from_linear(nn.Linear(64, 32))
    b = Int4Linear.from_linear(nn.Linear(32, 16), group_size=32)

    def both(x):
        return b(torch.relu(a(x)))

    x = torch.randn(1, 1, 64)
    compiled = torch.compile(both, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), both(x), rtol=1e-5, atol=1e-5)


def test_compiled_quantized_decode_gives_the_eager_tokens():
    """generate(compile=True) on an int8 model, batch 1: the CPU decode backend (reductions, each linear's
    input stored once for int8 weights) gives the same greedy tokens as the eager quantized model."""
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=40, d_model=32, n_heads=4, n_layer=2, d_ff=64, max_seq_len=64, init_std=0.2)
    model = quantize(TransformerLM(cfg).eval(), "int8")
    idx = torch.randint(0, 40, (1, 4))
    assert torch.equal(generate(model, idx, 40, compile=True), generate(model, idx, 40))


def test_nibble_packing_round_trips():
    q = torch.randint(0, 16, (7, 10))
    packed = pack_nibbles(q)
    assert packed.shape == (7, 5) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), q.to(torch.int32))


def tiny_model(**overrides) -> TransformerLM:
    cfg = TransformerConfig.from_preset("tiny", **overrides)
    return TransformerLM(cfg).eval()


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("preset_overrides", [{}, {"pos_emb": "rope", "norm": "rmsnorm", "ffn": "swiglu",
                                                   "tie_weights": False, "n_kv_heads": 2}], ids=["gpt", "llama"])
def test_quantize_replaces_every_linear_in_place(mode, preset_overrides):
    model = tiny_model(**preset_overrides)
    idx = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        float_logits, _ = model(idx)
    same = quantize(model, mode, group_size=32)
    assert same is model and isinstance(model, TransformerLM)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.quantization == {"mode": mode, "group_size": 32, "skipped": []}
    with torch.no_grad():
        logits, _ = model(idx)
    # the whole model drifts a little (int4 more than int8) but stays close to the float model
    tolerance = 0.05 if mode == "int8" else 0.5
    assert float((logits - float_logits).abs().max()) < tolerance * float(float_logits.abs().max())
    assert generate(model, idx, 4).shape == (2, 4)


def test_int4_leaves_layers_that_do_not_divide_into_groups_in_float():
    model = quantize(tiny_model(d_ff=200), "int4", group_size=64)  # fc2 has 200 inputs
    assert model.quantization["skipped"] == [f"blocks.{i}.ffn.fc2" for i in range(2)]
    assert isinstance(model.blocks[0].ffn.fc2, nn.Linear)
    assert isinstance(model.blocks[0].ffn.fc1, Int4Linear)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_checkpoint_round_trips(tmp_path, mode):
    model = quantize(tiny_model(), mode, group_size=32)
    model.save_pretrained(tmp_path)
    loaded = TransformerLM.from_pretrained(tmp_path)
    assert loaded.quantization == model.quantization
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    idx = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx)[0], model(idx)[0], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("tied", [True, False])
def test_quantized_checkpoint_loads_through_from_pretrained(tmp_path, mode, tied):
    """One loader: from_pretrained sees quantization.json and rebuilds the quantized model, head included
    (a tied head was quantized into its own copy, so it must have been saved beside the embedding)."""
    model = quantize(tiny_model(tie_weights=tied), mode, group_size=32)
    model.save_pretrained(tmp_path)  # writes quantization.json beside the weights
    assert json.loads((tmp_path / "quantization.json").read_text()) == model.quantization
    assert "quantization.json" in json.loads((tmp_path / "manifest.json").read_text())["files"]
    loaded = TransformerLM.from_pretrained(tmp_path)
    assert type(loaded.lm_head) is type(model.lm_head) is (Int8Linear if mode == "int8" else Int4Linear)
    assert loaded.quantization == model.quantization
    idx = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx)[0], model(idx)[0], rtol=0, atol=0)


def test_a_float_tied_head_is_still_stored_once(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    loaded = TransformerLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.tok_emb.weight


def test_damaged_quantized_weights_are_refused_by_the_manifest(tmp_path):
    quantize(tiny_model(), "int8").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's bytes: same size, a slightly different weight
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not match the sha256"):
        TransformerLM.from_pretrained(tmp_path)


def test_server_build_context_serves_a_quantized_checkpoint(tmp_path):
    from server_support import make_char_checkpoint, offline_greedy

    from mini_transformer.server import build_context

    model, tokenizer = make_char_checkpoint(tmp_path)
    quantized = quantize(model, "int4", group_size=32)
    quantized.save_pretrained(tmp_path)  # over the float files: same directory, same tokenizer
    ctx = build_context(tmp_path, num_blocks=32, block_size=4)
    served = ctx.engine_loop.engine.model
    assert served.quantization == quantized.quantization
    prompt = tokenizer.encode("hello there")
    assert offline_greedy(served, [prompt], 6) == offline_greedy(quantized, [prompt], 6)


def test_quantize_door_errors(tmp_path):
    with pytest.raises(ValueError, match="mode='int3'"):
        quantize(tiny_model(), "int3")
    with pytest.raises(ValueError, match="group_size=3"):
        quantize(tiny_model(), "int4", group_size=3)
    model = quantize(tiny_model(), "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize(model, "int4")


def test_sample_cli_quantize_flag_and_quantized_checkpoint(tmp_path, capsys):
    from mini_transformer.cli import main
    from mini_transformer.tokenizer import CharTokenizer

    tokenizer = CharTokenizer.train("the quick brown fox jumps over the lazy dog")
    model = tiny_model(vocab_size=tokenizer.vocab_size, init_std=0.3)
    model.save_pretrained(tmp_path / "float")
    tokenizer.save(tmp_path / "float")
    args = ["--prompt", "the fox", "--max-new-tokens", "12", "--temperature", "0"]
    assert main(["sample", "--checkpoint", str(tmp_path / "float"), "--quantize", "int8", *args]) == 0
    quantized = quantize(model, "int8")
    expected = generate(quantized, torch.tensor([tokenizer.encode("the fox")]), 12)
    assert capsys.readouterr().out == "the fox" + tokenizer.decode(expected[0].tolist()) + "\n"
    quantized.save_pretrained(tmp_path / "int8")
    tokenizer.save(tmp_path / "int8")
    assert main(["sample", "--checkpoint", str(tmp_path / "int8"), *args]) == 0
    assert capsys.readouterr().out == "the fox" + tokenizer.decode(expected[0].tolist()) + "\n"
    assert main(["sample", "--checkpoint", str(tmp_path / "int8"), "--quantize", "int4", *args]) == 2
    assert "already quantized" in capsys.readouterr().err
