"""Weight-only quantization: each quantized linear against its float64 reference within the bound its
scales imply (rounding moves a weight by at most half a step), the packed kernels against
dequantize-then-matmul, quantize() on a whole model in place, and safetensors save/load round trips."""

import json

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from support import on_threads

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM, generate
from mini_transformer.checkpoint import CheckpointError
from mini_transformer.engine import EngineConfig
from mini_transformer.model.int4_gemv import int4_gemv_reference, kernel_available
from mini_transformer.model.quantize import (
    Int4Linear,
    Int8Linear,
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


def activation_bound(x: torch.Tensor, layer: Int4Linear) -> torch.Tensor:
    """(M, N) bound on what rounding the activations to int8 per group adds: each x_k moves by at most
    dx_g / 2 (dx_g = max |x| over its group / 127), times |w_hat| summed over the group."""
    G, gs = layer.in_features // layer.group_size, layer.group_size
    dx = x.double().view(-1, G, gs).abs().amax(dim=-1) / 127  # (M, G)
    w_abs = layer.dequantize().double().abs().view(layer.out_features, G, gs).sum(dim=-1)  # (N, G)
    return dx / 2 @ w_abs.T


@settings(max_examples=10, deadline=None)
@given(groups=st.integers(1, 4), group_size=st.sampled_from([16, 32, 64]), out_features=st.sampled_from([5, 16, 48]),
       rows=st.integers(1, 3))
def test_int4_linear_within_its_group_scale_bound(groups, group_size, out_features, rows):
    """Int4Linear rounds weights to 4 bits and, in its GEMV, the activations to 8 bits per group: the
    error against the float64 layer stays within the sum of the two rounding bounds."""
    in_features = groups * group_size
    linear = nn.Linear(in_features, out_features)
    layer = Int4Linear.from_linear(linear, group_size)
    scale = layer.scales_and_zeros[..., 0].T  # (N, G)
    step = scale.repeat_interleave(group_size, dim=1)  # (N, K): each weight's group step
    x = torch.randn(rows, in_features)
    want = x.double() @ linear.weight.double().T + linear.bias.double()
    bound = rounding_bound(x, step, linear.weight) + activation_bound(x, layer)
    assert bool(((layer(x).double() - want).abs() <= bound).all())


def reference_in_float64(x, layer: Int4Linear) -> torch.Tensor:
    """The GEMV's definition, computed in float64 from scratch. With w = q * scale + low per group:
    y = sum_k x_hat_k * q_k * scale + x_k * low, x_hat = x rounded to int8 steps of its group's dx
    (the group minimum multiplies the exact sum of x: one float per group, nothing to round).
    The activation's int8 codes are defined in float32, as the kernel computes them (dx = amax / 127 and
    x / dx in float32): in float64 a value a hair from a .5 boundary can round to the neighbouring code,
    which moves y by dx * scale (seen: 4.5e-4 relative, K = 2048)."""
    G, gs, N = layer.in_features // layer.group_size, layer.group_size, layer.out_features
    xg = x.float().view(-1, G, gs)
    dx = xg.abs().amax(dim=-1, keepdim=True) / 127  # float32, as defined
    codes = torch.where(dx == 0, 0.0, torch.round(xg / dx))  # exact small integers
    x_hat = (codes.double() * dx.double()).view(x.shape)
    q = unpack_nibbles(layer.weight).double().view(N, G, gs)
    scale, low = layer.gemv_scale_low.double()[..., None].unbind(-2)  # (N, G, 1) each
    return x_hat @ (q * scale).view(N, -1).T + x.double() @ low.expand(N, G, gs).reshape(N, -1).T


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_int4_gemv_kernel_and_reference_agree_with_float64(threads, group_size, rows):
    """The C++ kernel (VNNI or its scalar loop) and the PyTorch reference: the same integer dot products,
    so they differ only in the order of float sums; both match the definition in float64."""
    torch.manual_seed(group_size + rows)
    layer = Int4Linear.from_linear(nn.Linear(256, 80, bias=False), group_size)
    x = torch.randn(rows, 256) * torch.rand(256) * 4  # groups of different ranges
    x[:, :group_size] = 0  # a group of zeros: dx = 0
    want = reference_in_float64(x, layer)
    ref = int4_gemv_reference(x, layer.weight, layer.gemv_scale_low, group_size)
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5)
    if not kernel_available():
        pytest.skip("the int4 C++ kernel cannot be built here")
    assert layer.gemv_kernel
    got = torch.ops.mt_gemv.int4(x, layer.weight, layer.gemv_scale_low, group_size)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# `threads` (the torch thread count) holds for every example
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(group_size=st.sampled_from([32, 64, 128, 256]), groups=st.integers(1, 9), out_features=st.integers(1, 70),
       rows=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_int4_gemv_kernel_over_shapes(threads, group_size, groups, out_features, rows, seed):
    """Every path of the C++ kernel (the VNNI loop for K a multiple of 128 and groups of 64 or 128k, the AVX2
    loop for other groups of 64k, the plain loop for group 32) against the float64 definition, for any rows
    and width."""
    if not kernel_available():
        pytest.skip("the int4 C++ kernel cannot be built here")
    torch.manual_seed(seed)
    K = group_size * groups
    layer = Int4Linear.from_linear(nn.Linear(K, out_features, bias=False), group_size)
    x = torch.randn(rows, K) * torch.rand(K) * 4
    got = torch.ops.mt_gemv.int4(x, layer.weight, layer.gemv_scale_low, group_size)
    torch.testing.assert_close(got.double(), reference_in_float64(x, layer), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_size, K", [(64, 192), (192, 768), (320, 1280), (128, 640)])
def test_int4_gemv_kernel_groups_that_do_not_fit_the_vnni_step(threads, group_size, K):
    """The VNNI loop steps 128 inputs: K = 192 at group 64 (an odd number of groups) and groups of 64 x odd
    (192, 320) go to the AVX2 loop, which reads no input past its row; group 128 at K = 640 stays on VNNI."""
    if not kernel_available():
        pytest.skip("the int4 C++ kernel cannot be built here")
    torch.manual_seed(K)
    layer = Int4Linear.from_linear(nn.Linear(K, 9, bias=False), group_size)
    x = torch.randn(3, K) * torch.rand(K) * 4
    got = torch.ops.mt_gemv.int4(x, layer.weight, layer.gemv_scale_low, group_size)
    torch.testing.assert_close(got.double(), reference_in_float64(x, layer), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_size", [32, 64])  # the plain loop (K = 64 x odd) and the SIMD one
def test_int4_gemv_kernel_same_bits_on_1_and_2_threads(group_size):
    """1003 weight rows: at 2 threads csrc/row_split.h gives each thread half of them, the second half starting
    at row 501, inside a block of the 4-row loop; each row is summed in the order 1 thread would, so the bits are
    the same."""
    if not kernel_available():
        pytest.skip("the int4 C++ kernel cannot be built here")
    torch.manual_seed(group_size)
    K = 64 * 15 if group_size == 32 else 1024
    layer = Int4Linear.from_linear(nn.Linear(K, 1003, bias=False), group_size)
    x = torch.randn(3, K)
    args = (x, layer.weight, layer.gemv_scale_low, group_size)
    assert torch.equal(on_threads(1, torch.ops.mt_gemv.int4, *args), on_threads(2, torch.ops.mt_gemv.int4, *args))


def assert_rows_same_alone_or_among_rows(int4_op, group_size: int, K: int) -> None:
    """11 weight rows through `int4_op` (a build's mt_gemv.int4): each row's output equals that row's alone (a
    1-row weight), whichever block of the 4-row loops it fell in."""
    torch.manual_seed(K)
    layer = Int4Linear.from_linear(nn.Linear(K, 11, bias=False), group_size)
    x = torch.randn(2, K)
    together = int4_op(x, layer.weight, layer.gemv_scale_low, group_size)
    for n in range(11):
        alone = int4_op(x, layer.weight[n:n + 1], layer.gemv_scale_low[n:n + 1], group_size)
        assert torch.equal(alone, together[:, n:n + 1])


def test_int4_gemv_kernel_row_same_bits_alone_or_among_rows():
    """The SIMD loop (VNNI, or AVX2 without it) takes weight rows 4 at a time and the last ones singly. K = 640:
    a row's 40 scales and minimums are one full register of the minimums' FMA and a masked one."""
    if not kernel_available():
        pytest.skip("the int4 C++ kernel cannot be built here")
    assert_rows_same_alone_or_among_rows(torch.ops.mt_gemv.int4, 64, 640)


def test_int8_kernel_equals_dequantize_then_matmul():
    linear = nn.Linear(96, 48)
    layer = Int8Linear.from_linear(linear)
    layer.use_kernel = True  # aten._weight_int8pack_mm (runs on this CPU build; opt-in because it is slow)
    x = torch.randn(2, 3, 96)
    want = x.double() @ layer.dequantize().double().T + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_features", [32, 40])  # 40: padded to 48 rows for the kernel, cut back
def test_int4_aten_kernel_equals_dequantize_then_matmul(out_features):
    layer = Int4Linear.from_linear(nn.Linear(128, out_features), group_size=32, use_kernel=True)
    assert layer.kernel_weight is not None
    x = torch.randn(2, 3, 128)
    want = x.double() @ layer.dequantize().double().T + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def test_fused_int8_rowwise_form_equals_dequantize_then_matmul():
    """The multiply-and-sum form a compiled decode step uses, run eagerly here against float64."""
    x = torch.randn(3, 128)
    int8 = Int8Linear.from_linear(nn.Linear(128, 24))
    want = x.double() @ int8.dequantize().double().T
    torch.testing.assert_close(int8_rowwise(x, int8.weight, int8.scales).double(), want, rtol=1e-5, atol=1e-5)


def test_compiled_quantized_linears_take_the_fused_path():
    """Under torch.compile a one-row input goes through the fused reduction; same numbers as eager."""
    a = Int8Linear.from_linear(nn.Linear(64, 32))
    b = Int4Linear.from_linear(nn.Linear(32, 16), group_size=32)

    def both(x):
        return b(torch.relu(a(x)))

    x = torch.randn(1, 1, 64)
    compiled = torch.compile(both, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), both(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [True, False], ids=["gemv_int8", "fused-reduction"])
def test_compiled_quantized_decode_gives_the_eager_tokens(kernel):
    """generate(compile=True) on an int8 model, batch 1, gives the same greedy tokens as the eager quantized
    model: through the C++ GEMV's int8 loop where it is built (every linear one mt_float.gemv_int8 call), and
    through the fused reductions of the CPU decode backend without it (each linear's input stored once)."""
    from torch._inductor.utils import run_and_get_code

    from mini_transformer.model import float_gemv

    if kernel and not float_gemv.kernel_available(torch.int8):
        pytest.skip("no SIMD build of the int8 GEMV here")
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=40, d_model=32, n_heads=4, n_layer=2, d_ff=64, max_seq_len=64, init_std=0.2)
    model = quantize(TransformerLM(cfg).eval(), "int8")
    for layer in model.modules():
        if isinstance(layer, Int8Linear):
            layer.gemv_kernel = kernel
    idx = torch.randint(0, 40, (1, 4))
    got, code = run_and_get_code(generate, model, idx, 40, compile=True)
    calls = sum(c.count("mt_float.gemv_int8") for c in code)
    linears = sum(isinstance(m, Int8Linear) for m in model.modules())
    assert code and (calls >= linears if kernel else calls == 0)
    assert torch.equal(got, generate(model, idx, 40))


def test_int8_layer_takes_the_gemv_loop_only_where_its_weights_arrive_on_the_cpu():
    """A layer made empty (as from_pretrained makes it, or on another device) does not build the C++; its
    weights arriving on the CPU (from_linear, a state_dict load) decide."""
    from mini_transformer.model import float_gemv

    built = float_gemv.kernel_available(torch.int8)
    assert not Int8Linear(16, 8, bias=False, device="meta").gemv_kernel
    layer = Int8Linear.from_linear(nn.Linear(16, 8))
    empty = Int8Linear(16, 8, bias=True)
    assert layer.gemv_kernel == built and not empty.gemv_kernel
    empty.load_state_dict(layer.state_dict())
    assert empty.gemv_kernel == built


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
    ctx = build_context(tmp_path, config=EngineConfig(num_blocks=32, block_size=4))
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


# ------------------------------------------- quantized and 16-bit models through the engine and `serve`
def llama_model(dtype=torch.float32, mode=None) -> TransformerLM:
    """A small confident Llama (init_std 0.3: its greedy choices are far from ties), cast, then quantized
    (as `serve --dtype --quantize` does: the quantized layers keep float32 scales)."""
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=60, d_model=64, n_heads=4, n_kv_heads=2, n_layer=2, d_ff=128, max_seq_len=64,
                            pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False, tie_weights=False, init_std=0.3)
    model = TransformerLM(cfg).eval().to(dtype)
    return quantize(model, mode, group_size=32) if mode else model


@pytest.mark.parametrize("mode,dtype", [("int8", torch.float32), (None, torch.bfloat16)])
def test_engine_greedy_equals_generate_on_the_same_quantized_model(mode, dtype):
    """Ragged prompts through the engine (their tokens packed into one forward, decode rows of several
    requests together) give generate()'s greedy tokens, each prompt alone. (int4 is not listed: its
    activation rounding turns a 1-ulp difference in the engine's attention into a jump of one int8 step,
    and on main's engine one of these prompts then flips a near-tie at its 11th token; see docs/08b §3.)"""
    from mini_transformer.engine import LLMEngine

    model = llama_model(dtype, mode)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 60, (n,), generator=gen).tolist() for n in (5, 17, 9, 1)]
    want = [generate(model, torch.tensor([p]), 12)[0].tolist() for p in prompts]
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64))
    assert engine.generate(prompts, SamplingParams(max_tokens=12), use_tqdm=False) == want


def test_int4_rows_do_not_depend_on_their_batch():
    """The property the engine relies on: a row's int4 output is the same alone, in a batch, in a prefill."""
    layer = Int4Linear.from_linear(nn.Linear(128, 40), group_size=64)
    x = torch.randn(20, 128)
    together = layer(x)
    for i in (0, 7, 19):
        assert torch.equal(layer(x[i:i + 1]), together[i:i + 1])


def test_serve_cli_quantize_and_dtype_reach_the_engine(tmp_path, monkeypatch):
    """`serve --quantize int4 --dtype bfloat16` builds its engine on the model quantized and cast as asked."""
    from server_support import make_char_checkpoint

    from mini_transformer import server
    from mini_transformer.cli import main

    make_char_checkpoint(tmp_path)
    served = {}
    monkeypatch.setattr(server, "serve", lambda ctx, **kw: served.update(model=ctx.engine_loop.engine.model))
    assert main(["serve", "--checkpoint", str(tmp_path), "--quantize", "int4", "--group-size", "32",
                 "--dtype", "bfloat16", "--port", "0"]) == 0
    model = served["model"]
    assert model.quantization["mode"] == "int4" and model.tok_emb.weight.dtype == torch.bfloat16
    assert isinstance(model.lm_head, Int4Linear)
