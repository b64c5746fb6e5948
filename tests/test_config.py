import math

import pytest

from mini_transformer import TransformerConfig
from mini_transformer.config import PRESETS, llama_ffn_size, small_init_std


def test_defaults_and_d_head():
    cfg = TransformerConfig()
    assert cfg.d_ff == 4 * cfg.d_model
    assert cfg.d_head == 64
    assert cfg.n_kv_heads == cfg.n_heads


def test_swiglu_uses_llama_sizing():
    cfg = TransformerConfig(d_model=4096, n_heads=32, ffn="swiglu", ffn_multiple_of=256)
    assert cfg.d_ff == 11008 == llama_ffn_size(4096, 256)


def test_explicit_d_ff_wins():
    assert TransformerConfig(d_model=64, n_heads=4, d_ff=100, ffn="swiglu").d_ff == 100


def test_init_std_defaults_to_the_width_rule():
    assert small_init_std(128) == pytest.approx(math.sqrt(2 / 640))
    assert small_init_std(768) == pytest.approx(0.0228, abs=1e-4)  # GPT-2's width: close to its fixed 0.02
    assert TransformerConfig(d_model=128, n_heads=4).init_std == small_init_std(128)
    assert TransformerConfig(d_model=128, n_heads=4, init_std=0.02).init_std == 0.02  # an explicit value wins
    assert TransformerConfig.from_preset("gpt2-small").init_std == 0.02  # GPT-2's own value


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build(name):
    cfg = TransformerConfig.from_preset(name)
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg


def test_tiny_preset_has_the_debug_sizes():
    cfg = TransformerConfig.from_preset("tiny")
    sizes = (cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.n_layer, cfg.max_seq_len)
    assert sizes == (100, 64, 4, 256, 2, 32)


def test_preset_overrides():
    assert TransformerConfig.from_preset("tiny", n_layer=3).n_layer == 3


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(d_model=100, n_heads=3), ["d_model=100", "n_heads=3", "divisible"]),
        (dict(d_model=0), ["d_model=0", "positive"]),
        (dict(n_layer=-1), ["n_layer=-1", "positive"]),
        (dict(vocab_size=0), ["vocab_size=0"]),
        (dict(max_seq_len=0), ["max_seq_len=0"]),
        (dict(d_ff=0), ["d_ff=0"]),
        (dict(attn_pdrop=1.0), ["attn_pdrop=1.0", "[0, 1)"]),
        (dict(resid_pdrop=-0.1), ["resid_pdrop=-0.1"]),
        (dict(embd_pdrop=1.5), ["embd_pdrop=1.5"]),
        (dict(pos_emb="alibi"), ["pos_emb='alibi'", "learned"]),
        (dict(norm_position="middle"), ["norm_position='middle'", "pre"]),
        (dict(norm="batchnorm"), ["norm='batchnorm'"]),
        (dict(ffn="tanh"), ["ffn='tanh'"]),
        (dict(attn_backend="cuda"), ["attn_backend='cuda'", "naive", "sdpa"]),
        (dict(n_heads=12, n_kv_heads=5), ["n_kv_heads=5", "n_heads=12"]),
        (dict(n_kv_heads=0), ["n_kv_heads=0"]),
        (dict(rope_theta=0.0), ["rope_theta"]),
        (dict(norm_eps=-1.0), ["norm_eps"]),
        (dict(init_std=0.0), ["init_std=0.0", "positive"]),
        (dict(norm_eps=math.inf), ["norm_eps=inf", "finite"]),
        (dict(rope_theta=math.inf), ["rope_theta=inf", "finite"]),
        (dict(rope_theta=math.nan), ["rope_theta=nan"]),
        (dict(init_std=math.inf), ["init_std=inf"]),
        (dict(d_model=36, n_heads=4, pos_emb="rope"), ["even d_head", "d_head=9"]),
    ],
)
def test_invalid_values_raise_value_error_naming_field(kwargs, words):
    with pytest.raises(ValueError) as err:
        TransformerConfig(**kwargs)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("kwargs", [dict(d_model=64.0), dict(n_layer="2"), dict(bias="yes"), dict(attn_pdrop="0.1")])
def test_wrong_types_raise_type_error(kwargs):
    with pytest.raises(TypeError):
        TransformerConfig(**kwargs)


def test_unknown_preset_and_unknown_field():
    with pytest.raises(ValueError, match="preset='gpt5'"):
        TransformerConfig.from_preset("gpt5")
    with pytest.raises(ValueError, match="unknown fields"):
        TransformerConfig.from_dict({"d_modle": 64})
