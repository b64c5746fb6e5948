"""The command line: info, trace, errors."""

import pytest

from mini_transformer.cli import main, parse_overrides
from mini_transformer.cli.info import count_parameters, kv_bytes_per_token
from mini_transformer.cli.trace import trace
from mini_transformer.config import TransformerConfig


def test_info_gpt2_small(capsys):
    assert main(["info", "--preset", "gpt2-small"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out and "163,037,184" in out  # tied and untied totals
    assert "d_head=64" in out
    assert "fp32 474.7 MiB" in out and "bf16 237.4 MiB" in out


def test_parameter_groups_add_up():
    cfg = TransformerConfig.from_preset("gpt2-small")
    groups = count_parameters(cfg)
    assert groups["token embedding"] == 50257 * 768
    assert groups["position embedding"] == 1024 * 768
    assert groups["attention"] == 12 * (768 * 3 * 768 + 3 * 768 + 768 * 768 + 768)
    assert groups["ffn"] == 12 * (768 * 3072 + 3072 + 3072 * 768 + 768)
    assert groups["lm head"] == 0
    assert sum(groups.values()) == 124_439_808


def test_kv_bytes_per_token_mha_gqa_mqa():
    cfg = TransformerConfig.from_preset("llama-tiny")  # 2 layers, 4 heads, 2 kv heads, d_head 16
    assert kv_bytes_per_token(cfg, bytes_per_value=2) == 2 * 2 * 2 * 16 * 2
    assert kv_bytes_per_token(cfg, n_kv_heads=4, bytes_per_value=4) == 2 * 2 * 4 * 16 * 4
    assert kv_bytes_per_token(cfg, n_kv_heads=1) == 2 * 2 * 1 * 16 * 2


def test_trace_prints_real_shapes_at_every_stage():
    out = trace(TransformerConfig.from_preset("tiny"), batch_size=2, seq_len=8)
    for line in ["token ids", "(2, 8, 64)", "W_qkv", "(2, 8, 192)", "(2, 4, 8, 16)", "scores", "(2, 4, 8, 8)",
                 "weights", "ffn up-projection", "(2, 8, 256)", "final norm", "logits", "(2, 8, 100)"]:
        assert line in out
    assert out.count("block 0") == 1 and out.count("block 1") == 1


def test_trace_gqa_shows_fewer_kv_heads(capsys):
    assert main(["trace", "--preset", "llama-tiny", "--seq-len", "4"]) == 0
    out = capsys.readouterr().out
    assert "(2, 4, 4, 16)" in out and "(2, 2, 4, 16)" in out and "RoPE" in out


def test_trace_leaves_no_hooks_behind():
    from mini_transformer import TransformerLM
    from mini_transformer.cli.trace import ShapeRecorder

    model = TransformerLM(TransformerConfig.from_preset("tiny"))
    recorder = ShapeRecorder(model)
    recorder.remove()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_set_overrides_are_typed():
    assert parse_overrides(["n_layer=3", "attn_pdrop=0.1", "bias=false", "pos_emb=rope", "d_ff=none"]) == {
        "n_layer": 3, "attn_pdrop": 0.1, "bias": False, "pos_emb": "rope", "d_ff": None}
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["n_layer"])


def test_bad_values_exit_2_with_a_message(capsys):
    assert main(["trace", "--preset", "tiny", "--seq-len", "99"]) == 2
    assert "max_seq_len=32" in capsys.readouterr().err
    assert main(["info", "--set", "d_model=100"]) == 2
    assert "d_model=100" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["info", "--preset", "gpt5"])


def test_failures_are_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    from mini_transformer import cli

    def broken(args):
        raise RuntimeError("something inside broke\nover two lines")

    monkeypatch.setattr(cli, "_run_info", broken)  # the parser is built inside main(): it takes this one
    assert main(["info"]) == 1  # not a user error: exit 1, still one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error: RuntimeError: something inside broke over two lines" in err
    assert "--debug" in err
    for argv in (["--debug", "info"], ["info", "--debug"]):
        with pytest.raises(RuntimeError, match="something inside broke"):
            main(argv)


def test_interrupt_is_one_line(capsys, monkeypatch):
    from mini_transformer import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run_info", interrupted)
    assert main(["info"]) == 130
    assert capsys.readouterr().err == "mini-transformer info: interrupted\n"


@pytest.mark.parametrize("device, words", [("foo", "not a device name"), ("cuda:7", "not available"),
                                           ("meta", "not a device name")])
@pytest.mark.parametrize("command", ["train", "sample"])
def test_a_device_that_is_not_there_is_named(tmp_path, capsys, command, device, words):
    import torch

    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that GPU")
    extra = ["--checkpoint", str(tmp_path), "--prompt", "a"] if command == "sample" else ["--out", str(tmp_path)]
    assert main([command, "--device", device, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"device={device!r}" in err and words in err


# ---- MoE: total vs active parameters, and the router in the trace ---------------------------------


def test_moe_active_parameters_match_mixtral_and_qwen3_moe_published_counts():
    """Mixtral-8x7B: 46.7B parameters, 12.9B active; Qwen3-30B-A3B: 30.5B, 3.3B active (their model cards)."""
    from mini_transformer.cli.info import active_parameters

    mixtral = TransformerConfig.from_preset("moe-tiny", vocab_size=32000, d_model=4096, n_heads=32, n_kv_heads=8,
                                            n_layer=32, d_ff=14336, n_experts=8, n_experts_per_tok=2)
    groups = count_parameters(mixtral)
    assert round(sum(groups.values()) / 1e9, 1) == 46.7
    assert round(active_parameters(mixtral, groups) / 1e9, 1) == 12.9
    qwen = TransformerConfig.from_preset("moe-tiny", vocab_size=151936, d_model=2048, n_heads=32, head_dim=128,
                                         n_kv_heads=4, n_layer=48, d_ff=768, n_experts=128, n_experts_per_tok=8,
                                         qk_norm=True)
    groups = count_parameters(qwen)
    assert round(sum(groups.values()) / 1e9, 1) == 30.5
    assert 3.3e9 <= active_parameters(qwen, groups) < 3.4e9  # the card truncates: 3.35B -> "3.3B"


def test_info_moe_splits_router_experts_and_shared_expert(capsys):
    assert main(["info", "--preset", "moe-tiny", "--set", "moe_shared_expert_size=32"]) == 0
    out = capsys.readouterr().out
    experts = 2 * 4 * 3 * 64 * 128  # layers * experts * (gate, up, down) * C * d_ff
    for name, count in (("ffn experts", experts), ("ffn router", 2 * 4 * 64), ("ffn shared expert", 2 * 3 * 64 * 32)):
        assert f"{name:<22}{count:>16,}" in out
    assert "active per token" in out and "one expert" in out and "expert memory" in out


def test_trace_moe_shows_router_top_k_and_counts():
    out = trace(TransformerConfig.from_preset("moe-tiny"), batch_size=2, seq_len=8)
    for line in ["router logits", "(16, 4)", "top-2 experts", "(16, 2)", "tokens per expert", "(32, 128)"]:
        assert line in out
    counts_lines = [line for line in out.splitlines() if "tokens per expert" in line]
    assert len(counts_lines) == 2  # one per layer
    for line in counts_lines:
        counts = line.split("[")[1].split("]")[0]
        assert sum(int(c) for c in counts.split(",")) == 16 * 2  # every token reached k experts
