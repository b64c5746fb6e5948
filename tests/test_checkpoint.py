"""Checkpoints: our own save/load round trip, and exact logits after importing tiny random Hugging Face
GPT-2 and Llama models (built from their config classes, no download). Run with -s to see the measured
max differences ("[parity] ..." lines)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import HF_VOCAB, edit_files, left_padded_batch, max_logit_diff, perturbed

from mini_transformer import TransformerConfig, TransformerLM
from mini_transformer.checkpoint import CheckpointError, clean_state_dict, load_state_into, write_checkpoint

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB = HF_VOCAB
TOLERANCE = 1e-5


def tiny_gpt2(**overrides):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0, **overrides)
    return perturbed(transformers.GPT2LMHeadModel(cfg))


def tiny_llama(**overrides):
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    cfg = transformers.LlamaConfig(**{**values, **overrides})
    return perturbed(transformers.LlamaForCausalLM(cfg))


def check_parity(name, hf_model, path, backend="naive"):
    hf_model.save_pretrained(path)
    ours = TransformerLM.from_pretrained(path, attn_backend=backend)
    assert not ours.training  # dropout off, like HF's from_pretrained
    diff_plain = max_logit_diff(hf_model, ours, torch.randint(0, VOCAB, (2, 16)))
    diff_padded = max_logit_diff(hf_model, ours, *left_padded_batch())
    print(f"\n[parity] {name} ({backend}): max abs diff {diff_plain:.2e}, left-padded {diff_padded:.2e}")
    assert diff_plain <= TOLERANCE and diff_padded <= TOLERANCE
    return ours


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_gpt2_tied_logits_match_hf(tmp_path, backend):
    ours = check_parity("gpt2 tied", tiny_gpt2(), tmp_path, backend)
    cfg = ours.config
    assert (cfg.ffn, cfg.pos_emb, cfg.norm, cfg.tie_weights) == ("gelu_tanh", "learned", "layernorm", True)
    assert ours.lm_head.weight is ours.tok_emb.weight


def test_gpt2_untied_with_custom_inner_size_and_eps(tmp_path):
    hf = tiny_gpt2(tie_word_embeddings=False, n_inner=40, layer_norm_epsilon=1e-3, activation_function="relu")
    ours = check_parity("gpt2 untied relu n_inner=40", hf, tmp_path)
    assert (ours.config.d_ff, ours.config.norm_eps, ours.config.ffn) == (40, 1e-3, "relu")


LLAMA_CASES = {
    "llama MHA tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "llama GQA untied": dict(num_key_value_heads=2),
    "llama MQA untied": dict(num_key_value_heads=1),
    "llama GQA rope_theta=500000": dict(rope_theta=500000.0),
    "llama biases": dict(attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5),
}


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_logits_match_hf(tmp_path, case, backend):
    hf = tiny_llama(**LLAMA_CASES[case])
    ours = check_parity(case, hf, tmp_path, backend)
    cfg, hf_cfg = ours.config, hf.config
    assert cfg.n_kv_heads == hf_cfg.num_key_value_heads
    assert cfg.rope_theta == hf_cfg.rope_parameters["rope_theta"]
    assert cfg.tie_weights == hf_cfg.tie_word_embeddings
    assert cfg.bias == hf_cfg.attention_bias
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    assert ours.blocks[0].attn.W_qkv.weight.shape == ((H + 2 * Hkv) * D, cfg.d_model)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_pytorch_model_bin(tmp_path, family):
    hf = tiny_gpt2() if family == "gpt2" else tiny_llama()
    hf.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")  # GPT-2's state_dict repeats the tied head
    ours = TransformerLM.from_pretrained(tmp_path)
    diff = max_logit_diff(hf, ours, torch.randint(0, VOCAB, (2, 16)))
    print(f"\n[parity] {family} pytorch_model.bin: max abs diff {diff:.2e}")
    assert diff <= TOLERANCE


def test_sharded_safetensors(tmp_path):
    hf = tiny_llama()
    hf.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard_names in shards.items():
        save_file({n: state[n] for n in shard_names}, str(tmp_path / file))
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert max_logit_diff(hf, TransformerLM.from_pretrained(tmp_path), torch.randint(0, VOCAB, (1, 8))) <= TOLERANCE


def test_gpt2_without_prefix_and_with_old_mask_buffers(tmp_path):
    """The original hub GPT-2 files have no `transformer.` prefix and carry causal-mask buffers."""
    hf = tiny_gpt2()
    hf.save_pretrained(tmp_path)
    state = {k.removeprefix("transformer."): v for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    for i in range(hf.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.ones(1, 1, 32, 32).tril()
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, str(tmp_path / "model.safetensors"))
    assert max_logit_diff(hf, TransformerLM.from_pretrained(tmp_path), torch.randint(0, VOCAB, (1, 8))) <= TOLERANCE


# ---- error paths ---------------------------------------------------------------------------------


def test_missing_tensor_is_named(tmp_path):
    edit_files(tmp_path, tiny_llama(), state=lambda s: s.pop("model.layers.1.self_attn.k_proj.weight"))
    expected = r"missing.*'model\.layers\.1\.self_attn\.k_proj\.weight' \(expected shape \(16, 32\)\)"
    with pytest.raises(ValueError, match=expected):
        TransformerLM.from_pretrained(tmp_path)


def test_untied_llama_without_head_is_an_error(tmp_path):
    edit_files(tmp_path, tiny_llama(), state=lambda s: s.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing.*'lm_head\.weight'"):
        TransformerLM.from_pretrained(tmp_path)


def test_extra_tensor_is_named(tmp_path):
    edit_files(tmp_path, tiny_gpt2(), state=lambda s: s.update({"transformer.h.0.attn.rotary": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"unexpected.*'transformer\.h\.0\.attn\.rotary' \(shape \(3,\)\)"):
        TransformerLM.from_pretrained(tmp_path)


def test_misshaped_tensor_names_both_shapes(tmp_path):
    wrong = {"transformer.h.1.attn.c_attn.weight": torch.zeros(96, 32)}  # (out, in) instead of Conv1D's (in, out)
    edit_files(tmp_path, tiny_gpt2(), state=lambda s: s.update(wrong))
    expected = r"'transformer\.h\.1\.attn\.c_attn\.weight' has shape \(96, 32\).*needs \(32, 96\)"
    with pytest.raises(ValueError, match=expected):
        TransformerLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(architectures=["BertForMaskedLM"]), "BertForMaskedLM"),
    (lambda c: (c.pop("architectures"), c.update(model_type="bert")), "model_type='bert'"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu'"),
    (lambda c: c.update(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "linear"),
    (lambda c: c.update(head_dim=16), "head_dim=16"),
    (lambda c: c.update(attention_bias=True), "attention_bias=True"),
])
def test_unsupported_llama_configs(tmp_path, edit, message):
    edit_files(tmp_path, tiny_llama(), config=edit)
    with pytest.raises(ValueError, match=message):
        TransformerLM.from_pretrained(tmp_path)


def test_llama_config_without_its_sizes_takes_llamas_defaults():
    from mini_transformer.checkpoint.rules import llama_config

    cfg = llama_config({"architectures": ["LlamaForCausalLM"]})
    assert (cfg.max_seq_len, cfg.d_ff) == (2048, 11008)


def test_unsupported_gpt2_config(tmp_path):
    edit_files(tmp_path, tiny_gpt2(), config=lambda c: c.update(scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        TransformerLM.from_pretrained(tmp_path)


def test_directory_without_config_or_weights(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        TransformerLM.from_pretrained(tmp_path)
    edit_files(tmp_path, tiny_llama())
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors or pytorch_model.bin"):
        TransformerLM.from_pretrained(tmp_path)


# ---- our own format -------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_own_round_trip(tmp_path, preset):
    model = TransformerLM(TransformerConfig.from_preset(preset)).eval()
    model.save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in stored) == (not model.config.tie_weights)  # a tied head is stored once
    loaded = TransformerLM.from_pretrained(tmp_path, attn_backend="sdpa")
    assert loaded.config == model.config.replace(attn_backend="sdpa")
    if model.config.tie_weights:
        assert loaded.lm_head.weight is loaded.tok_emb.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    torch.testing.assert_close(loaded(ids)[0], model(ids)[0], rtol=1e-5, atol=1e-5)  # naive vs sdpa in fp32


def test_own_config_has_model_type(tmp_path):
    TransformerLM(TransformerConfig.from_preset("tiny")).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "mini-transformer"
    assert TransformerConfig.from_dict({k: v for k, v in raw.items() if k != "model_type"}).d_model == 64


def test_prefixes_from_compile_and_ddp_are_removed(tmp_path):
    model = TransformerLM(TransformerConfig.from_preset("tiny"))
    prefixed = {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}
    assert clean_state_dict(prefixed).keys() == model.state_dict().keys()
    fresh = TransformerLM(TransformerConfig.from_preset("tiny"))
    load_state_into(fresh, prefixed)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    write_checkpoint(tmp_path, model.config, prefixed)  # names are written clean
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in load_file(str(tmp_path / "model.safetensors")))
    assert TransformerLM.from_pretrained(tmp_path).num_parameters() == model.num_parameters()


def test_own_checkpoint_errors_name_the_tensor(tmp_path):
    model = TransformerLM(TransformerConfig.from_preset("tiny"))
    state = dict(model.state_dict())
    state["blocks.0.attn.W_o.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'blocks\.0\.attn\.W_o\.weight' has shape \(3, 3\).*\(64, 64\)"):
        load_state_into(model, state)
    del state["blocks.0.attn.W_o.weight"]
    with pytest.raises(ValueError, match=r"missing tensors \['blocks\.0\.attn\.W_o\.weight'\]"):
        load_state_into(model, state)


# ---- integrity and the direction of imports ---------------------------------------------------------


def test_manifest_records_every_file_and_a_flipped_byte_is_named(tmp_path):
    TransformerLM(TransformerConfig.from_preset("tiny")).save_pretrained(tmp_path)
    recorded = json.loads((tmp_path / "manifest.json").read_text())["files"]
    assert sorted(recorded) == ["config.json", "model.safetensors"]
    weights = tmp_path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: same size, the tensor values just a little off
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not match the sha256"):
        TransformerLM.from_pretrained(tmp_path)


def test_hf_directory_needs_no_manifest_but_its_index_must_stay_inside(tmp_path):
    hf = tiny_llama()
    hf.save_pretrained(tmp_path)
    assert not (tmp_path / "manifest.json").exists()
    TransformerLM.from_pretrained(tmp_path)  # loads without one
    (tmp_path / "model.safetensors").rename(tmp_path.parent / "elsewhere.safetensors")
    for name in ("../elsewhere.safetensors", str(tmp_path.parent / "elsewhere.safetensors")):
        index = {"weight_map": {"model.embed_tokens.weight": name}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ValueError, match="outside the checkpoint directory"):
            TransformerLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("file", ["config.json", "model.safetensors", "pytorch_model.bin"])
def test_damaged_hf_files_are_named(tmp_path, file):
    hf = tiny_gpt2()
    hf.save_pretrained(tmp_path)
    if file == "pytorch_model.bin":
        (tmp_path / "model.safetensors").unlink()
        torch.save(hf.state_dict(), tmp_path / file)
    data = (tmp_path / file).read_bytes()
    (tmp_path / file).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=file.replace(".", r"\.")):
        TransformerLM.from_pretrained(tmp_path)
