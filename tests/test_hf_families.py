"""Hugging Face import of Mistral, Qwen2, Qwen3, Mixtral and Qwen3-MoE: logits equal to the transformers
class built from a tiny random config (no download), padded batches included; our save_pretrained round
trip; greedy generation of an imported Mixtral equal to HF's token for token; the config switches each
family maps to; and the errors for what we do not support. Run with -s for the "[parity] ..." lines."""


import pytest
import torch
from support import HF_VOCAB, edit_files, left_padded_batch, max_logit_diff, perturbed

from mini_transformer import TransformerLM, generate
from mini_transformer.checkpoint.families import ARCHITECTURES, FAMILIES
from mini_transformer.model.moe import MoE, load_balancing_loss

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB = HF_VOCAB
TOLERANCE = 1e-5
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=24)

# case -> (transformers class name, config values, {our config field: the value it must get})
CASES = {
    "mistral": ("Mistral", dict(sliding_window=None, rope_theta=1e6), dict(qk_norm=False, qkv_bias=None)),
    "mistral sliding window 16": ("Mistral", dict(sliding_window=16), dict(max_seq_len=16)),
    "qwen2 q/k/v biases, tied": ("Qwen2", dict(tie_word_embeddings=True), dict(qkv_bias=True, bias=False)),
    "qwen3 q/k norm, head_dim 16": ("Qwen3", dict(head_dim=16), dict(qk_norm=True, head_dim=16, d_head=16)),
    "qwen3 head_dim = C/H": ("Qwen3", dict(head_dim=8), dict(qk_norm=True, head_dim=None, d_head=8)),
    "mixtral 4 experts top-2": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2),
                                dict(ffn="moe", n_experts=4, n_experts_per_tok=2, moe_norm_topk_prob=True, d_ff=48,
                                     moe_aux_loss_coef=0.001 * 2)),  # HF's 0.001, scaled by k
    "qwen3-moe norm_topk_prob": ("Qwen3Moe", dict(num_experts=4, norm_topk_prob=True, head_dim=16, **MOE),
                                 dict(ffn="moe", n_experts=4, moe_norm_topk_prob=True, d_ff=24, qk_norm=True)),
    "qwen3-moe top-3 of 6": ("Qwen3Moe", dict(MOE, num_experts=6, norm_topk_prob=False, num_experts_per_tok=3),
                             dict(n_experts_per_tok=3, moe_norm_topk_prob=False)),
}


def hf_model(kind: str, values: dict):
    cfg = getattr(transformers, f"{kind}Config")(**{**COMMON, **values})
    return perturbed(getattr(transformers, f"{kind}ForCausalLM")(cfg))


def imported(case, path, backend="naive"):
    kind, values, _ = CASES[case]
    hf = hf_model(kind, values)
    hf.save_pretrained(path)
    return hf, TransformerLM.from_pretrained(path, attn_backend=backend)


def test_every_family_has_one_row_and_a_case_here():
    """One registry: every architecture names a row of FAMILIES, and every Llama-derived row is checked
    against Hugging Face by a case of CASES (GPT-2 and Llama by test_checkpoint.py)."""
    assert set(ARCHITECTURES.values()) == set(FAMILIES)
    families = set(FAMILIES) - {"gpt2", "llama"}
    assert {ARCHITECTURES[f"{kind}ForCausalLM"] for kind, _, _ in CASES.values()} == families


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(tmp_path, case):
    hf, ours = imported(case, tmp_path)
    diff_plain = max_logit_diff(hf, ours, torch.randint(0, VOCAB, (2, 16)))
    diff_padded = max_logit_diff(hf, ours, *left_padded_batch())
    print(f"\n[parity] {case}: max abs diff {diff_plain:.2e}, left-padded {diff_padded:.2e}")
    assert diff_plain <= TOLERANCE and diff_padded <= TOLERANCE
    for field, value in CASES[case][2].items():
        assert getattr(ours.config, field) == value, field


@pytest.mark.parametrize("case", ["qwen3 q/k norm, head_dim 16", "mixtral 4 experts top-2"])
def test_logits_match_hf_with_sdpa(tmp_path, case):
    hf, ours = imported(case, tmp_path, backend="sdpa")
    assert max_logit_diff(hf, ours, *left_padded_batch()) <= TOLERANCE


@pytest.mark.parametrize("case", ["mistral", "qwen2 q/k/v biases, tied", "qwen3 q/k norm, head_dim 16",
                                  "mixtral 4 experts top-2", "qwen3-moe norm_topk_prob"])
def test_save_pretrained_round_trip(tmp_path, case):
    hf, ours = imported(case, tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours")
    again = TransformerLM.from_pretrained(tmp_path / "ours")
    assert again.config == ours.config
    for name, tensor in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    ids, mask = left_padded_batch()
    assert max_logit_diff(hf, again, ids, mask) <= TOLERANCE


@pytest.mark.parametrize("pad_lengths", [[0], [0, 3, 5]], ids=["one-row", "left-padded"])
def test_mixtral_greedy_generation_matches_hf(tmp_path, pad_lengths):
    hf, ours = imported("mixtral 4 experts top-2", tmp_path)
    T = 6
    idx = torch.randint(1, VOCAB, (len(pad_lengths), T))
    mask = torch.ones_like(idx)
    for row, pad in enumerate(pad_lengths):
        idx[row, :pad], mask[row, :pad] = 0, 0
    n = 16
    expected = hf.generate(idx, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=0, eos_token_id=None)[:, T:]
    assert torch.equal(generate(ours, idx, n, attention_mask=mask), expected)
    assert torch.equal(generate(ours, idx, n, attention_mask=mask, use_cache=False), expected)


def test_load_balancing_loss_matches_hf_on_one_layer():
    """HF pools all layers and counts top-k assignments per token (its balanced value is k); on one
    layer ours (balanced value 1) is HF's divided by k, padding left out by the mask in both."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(3 * 5, 6) * 2
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, :2] = 0
    for k in (1, 2, 3):
        for m in (None, mask):
            expected = load_balancing_loss_func((logits,), 6, k, m) / k
            got = load_balancing_loss([logits], k, None if m is None else m.bool())
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_imported_mixtral_trains_with_the_aux_loss(tmp_path):
    _, ours = imported("mixtral 4 experts top-2", tmp_path)
    ids = torch.randint(0, VOCAB, (2, 10))
    _, plain = ours(ids, ids)  # eval mode: cross-entropy only
    ours.train()
    _, with_aux = ours(ids, ids)
    layers = [m for m in ours.modules() if isinstance(m, MoE)]
    aux = load_balancing_loss([m.router_logits for m in layers], 2)
    torch.testing.assert_close(with_aux, plain + ours.config.moe_aux_loss_coef * aux)
    with_aux.backward()
    assert all(m.router.weight.grad.abs().sum() > 0 for m in layers)


# ---- what is refused, with the field named --------------------------------------------------------


@pytest.mark.parametrize("case, edit, message", [
    ("qwen3-moe norm_topk_prob", lambda c: c.update(mlp_only_layers=[1]), r"mlp_only_layers=\[1\]"),
    ("qwen3-moe norm_topk_prob", lambda c: c.update(decoder_sparse_step=2), "decoder_sparse_step=2"),
    ("qwen3 q/k norm, head_dim 16", lambda c: c.update(attention_bias=True), "attention_bias=True"),
    ("mixtral 4 experts top-2", lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen2 q/k/v biases, tied", lambda c: c.update(architectures=["Qwen2VLForConditionalGeneration"]), "Qwen2VL"),
])
def test_unsupported_configs_are_named(tmp_path, case, edit, message):
    write_and_edit(tmp_path, case, config=edit)
    with pytest.raises(ValueError, match=message):
        TransformerLM.from_pretrained(tmp_path)


def test_missing_expert_tensor_is_named(tmp_path):
    write_and_edit(tmp_path, "mixtral 4 experts top-2",
                   state=lambda s: s.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
    with pytest.raises(ValueError, match=r"missing.*'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight' "
                                         r"\(expected shape \(32, 48\)\)"):
        TransformerLM.from_pretrained(tmp_path)


def test_qwen_sliding_window_counts_only_when_switched_on(tmp_path):
    write_and_edit(tmp_path, "qwen2 q/k/v biases, tied", config=lambda c: c.update(sliding_window=8))
    assert TransformerLM.from_pretrained(tmp_path).config.max_seq_len == 32  # use_sliding_window is False
    write_and_edit(tmp_path, "qwen2 q/k/v biases, tied",
                   config=lambda c: c.update(sliding_window=8, use_sliding_window=True))
    assert TransformerLM.from_pretrained(tmp_path).config.max_seq_len == 8


def write_and_edit(path, case, *, config=None, state=None):
    kind, values, _ = CASES[case]
    edit_files(path, hf_model(kind, values), config=config, state=state)


def test_a_family_config_without_its_sizes_takes_the_family_defaults():
    """A config.json missing max_position_embeddings / intermediate_size: 32k context and Mistral's d_ff
    (Llama's own defaults, 2048 and 11008, are rules.py's)."""
    from mini_transformer.checkpoint.families import family_config

    cfg = family_config({"architectures": ["MistralForCausalLM"]}, "mistral")
    assert (cfg.max_seq_len, cfg.d_ff) == (32768, 14336)
