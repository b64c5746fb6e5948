"""Stage 1 model: shapes, loss, causality, padding, dropout, gradients, tying, errors."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_transformer import TransformerConfig, TransformerLM
from mini_transformer.model.cache import NoCache

BACKENDS = ["naive", "sdpa"]
VARIANTS = [
    dict(),  # stage 1: learned positions, LayerNorm, GELU, pre-norm
    dict(norm_position="post"),
    dict(pos_emb="rope", norm="rmsnorm", ffn="swiglu", n_kv_heads=2, bias=False, tie_weights=False),
]


def tiny(**overrides) -> TransformerLM:
    return TransformerLM(TransformerConfig.from_preset("tiny", **overrides)).eval()


def ids(B=2, T=10, vocab=100):
    return torch.randint(0, vocab, (B, T))


def test_logits_shape_and_loss_is_cross_entropy():
    model = tiny()
    idx, targets = ids(), ids()
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 10, 100)
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(-1, 100), targets.reshape(-1)), atol=1e-6)
    assert model(idx)[1] is None


def test_loss_ignores_minus_100_and_never_nan():
    model = tiny()
    idx, targets = ids(), ids()
    masked = targets.clone()
    masked[:, :4] = -100
    logits, loss = model(idx, masked)
    expected = F.cross_entropy(logits[:, 4:].reshape(-1, 100), targets[:, 4:].reshape(-1))
    assert torch.allclose(loss, expected, atol=1e-6)
    _, empty = model(idx, torch.full_like(targets, -100))
    assert empty.item() == 0.0


def test_fused_qkv_split_equals_the_classic_permute():
    model = tiny()
    attn = model.blocks[0].attn
    x = torch.randn(2, 5, 64)
    qkv = attn.W_qkv(x)  # (B, T, 3C)
    classic_q, classic_k, classic_v = qkv.view(2, 5, 3, 4, 16).permute(2, 0, 3, 1, 4).unbind(0)  # (3, B, H, T, D)
    ours = qkv.view(2, 5, 12, 16).transpose(1, 2).split([4, 4, 4], dim=1)
    for a, b in zip((classic_q, classic_k, classic_v), ours, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_causality_future_tokens_do_not_change_past_logits(backend, variant):
    model = tiny(attn_backend=backend, **variant)
    idx = ids(T=12)
    changed = idx.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 100
    a, b = model(idx)[0], model(changed)[0]
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_left_and_right_padding_leave_real_logits_unchanged(backend, variant):
    model = tiny(attn_backend=backend, **variant)
    idx = ids(B=1, T=9)
    plain = model(idx)[0]
    pad = torch.zeros(1, 3, dtype=torch.long)
    left = model(torch.cat([pad, idx], 1), attention_mask=torch.tensor([[0] * 3 + [1] * 9]))[0]
    right = model(torch.cat([idx, pad], 1), attention_mask=torch.tensor([[1] * 9 + [0] * 3]))[0]
    assert (left[:, 3:] - plain).abs().max() <= 1e-5
    assert (right[:, :9] - plain).abs().max() <= 1e-5


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4), backend=st.sampled_from(BACKENDS))
def test_batched_left_padding_equals_each_row_alone(lengths, backend):
    model = tiny(attn_backend=backend)
    T = max(lengths)
    rows = [ids(B=1, T=n) for n in lengths]
    batch = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, row in enumerate(rows):
        batch[b, T - row.shape[1]:] = row[0]
        mask[b, T - row.shape[1]:] = 1
    logits = model(batch, attention_mask=mask)[0]
    for b, row in enumerate(rows):
        alone = model(row)[0]
        assert (logits[b, T - row.shape[1]:] - alone[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_padded_row_gives_no_nan(backend):
    model = tiny(attn_backend=backend).train()
    mask = torch.tensor([[0] * 6, [1] * 6])
    targets = ids(T=6)
    targets[0] = -100
    logits, loss = model(ids(T=6), targets, attention_mask=mask)
    loss.backward()
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_dropout_active_in_train_and_off_in_eval():
    model = tiny(attn_pdrop=0.3, resid_pdrop=0.3, embd_pdrop=0.3)
    idx = ids()
    eval_a, eval_b = model(idx)[0], model(idx)[0]
    assert torch.equal(eval_a, eval_b)
    no_dropout = TransformerLM(model.config.replace(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)).eval()
    no_dropout.load_state_dict(model.state_dict())
    assert torch.equal(no_dropout(idx)[0], eval_a)
    model.train()
    assert not torch.allclose(model(idx)[0], model(idx)[0])


@pytest.mark.parametrize("name", ["attn_pdrop", "resid_pdrop", "embd_pdrop"])
def test_each_dropout_switch_does_something(name):
    model = tiny(**{name: 0.5}).train()
    idx = ids()
    assert not torch.allclose(model(idx)[0], model(idx)[0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_parameter_gets_a_gradient(variant):
    model = tiny(**variant).train()
    _, loss = model(ids(), ids())
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_tied_weights_share_storage():
    model = tiny()
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    untied = tiny(tie_weights=False)
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    assert untied.num_parameters() == model.num_parameters() + 100 * 64


@pytest.mark.parametrize("pos_emb", ["learned", "rope", "sinusoidal", "none"])
def test_state_dict_holds_parameters_only(pos_emb):
    model = tiny(pos_emb=pos_emb)
    names = set(model.state_dict())
    assert names == {name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert not any("mask" in n or "cos" in n or "sin" in n for n in names)


@pytest.mark.parametrize("variant", VARIANTS)
def test_initial_weights_follow_init_std(variant):
    """Matrices and embeddings ~ N(0, init_std); the projections that write into the residual stream are
    scaled by 1/sqrt(2 * n_layer); biases start at 0 and norm gains at 1."""
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=512, d_model=128, n_heads=4, n_layer=2, max_seq_len=256, **variant)
    model = TransformerLM(cfg)
    residual_writers = ("W_o.weight", "fc2.weight", "w_down.weight")
    for name, p in model.named_parameters():
        if p.dim() < 2:
            assert torch.all(p == (1.0 if "norm" in name and name.endswith("weight") else 0.0)), name
            continue
        expected = cfg.init_std / (2 * cfg.n_layer) ** 0.5 if name.endswith(residual_writers) else cfg.init_std
        assert p.std().item() == pytest.approx(expected, rel=0.05), name
        assert p.mean().abs().item() < 0.1 * expected, name


def test_gpt2_small_has_gpt2_parameter_count():
    with torch.device("meta"):
        model = TransformerLM(TransformerConfig.from_preset("gpt2-small"))
    assert model.num_parameters() == 124_439_808


def test_post_norm_block_is_norm_of_residual_sum():
    model = tiny(norm_position="post")
    block = model.blocks[0]
    x = torch.randn(2, 5, 64)
    h = block.norm_1(x + block.attn(x, NoCache()))
    assert torch.allclose(block(x, NoCache()), block.norm_2(h + block.ffn(h)), atol=1e-6)
    pre = tiny().blocks[0]
    h = x + pre.attn(pre.norm_1(x), NoCache())
    assert torch.allclose(pre(x, NoCache()), h + pre.ffn(pre.norm_2(h)), atol=1e-6)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda m: m(torch.randint(0, 100, (10,))), ValueError, "2-D int64 or int32 tensor"),
        (lambda m: m(torch.rand(2, 5)), ValueError, "2-D int64 or int32 tensor"),
        (lambda m: m([[1, 2]]), ValueError, "2-D int64 or int32 tensor"),
        (lambda m: m(torch.tensor([[1, 2]], dtype=torch.uint8)), ValueError, "dtype torch.uint8"),
        (lambda m: m(torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.full((2, 5), 2)), ValueError,
         "only 0 (padding) and 1"),
        (lambda m: m(torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.full((2, 5), 0.5)), ValueError,
         "only 0 (padding) and 1"),
        (lambda m: m(torch.zeros(1, 5, dtype=torch.long), cache=object()), TypeError, "cache must be a KVCache"),
        (lambda m: m(torch.tensor([[1, 100]])), ValueError, "token id 100"),
        (lambda m: m(torch.tensor([[1, -3]])), ValueError, "token id -3"),
        (lambda m: m(torch.zeros(1, 33, dtype=torch.long)), ValueError, "max_seq_len=32"),
        (lambda m: m(torch.zeros(1, 0, dtype=torch.long)), ValueError, "T=0"),
        (lambda m: m(torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4)), ValueError,
         "attention_mask has shape (2, 4)"),
        (lambda m: m(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)), ValueError,
         "targets has shape (2, 4)"),
        (lambda m: m(torch.zeros(2, 5, dtype=torch.long), torch.full((2, 5), 100)), ValueError, "id 100"),
        (lambda m: m(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5)), ValueError, "integer"),
        (lambda m: TransformerLM({"d_model": 64}), TypeError, "TransformerConfig"),
        (lambda m: TransformerConfig.from_preset("nope"), ValueError, "preset='nope'"),
        (lambda m: TransformerConfig.from_preset("tiny", attn_backend="fast"), ValueError, "attn_backend='fast'"),
    ],
)
def test_error_paths(call, error, words):
    with pytest.raises(error) as err:
        call(tiny())
    assert words in str(err.value)


def test_logits_at_computes_only_the_rows_asked_for():
    model = tiny().eval()
    idx = torch.randint(0, 100, (2, 9))
    at = torch.tensor([0, 4, -1])
    with torch.no_grad():
        full, _ = model(idx)
        some, _ = model(idx, logits_at=at)
    assert some.shape == (2, 3, full.shape[-1])
    torch.testing.assert_close(some, full[:, at], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="logits_at and targets"):
        model(idx, idx, logits_at=at)
    with pytest.raises(ValueError, match=r"outside \[-9, 9\)"):
        model(idx, logits_at=torch.tensor([9]))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        model(idx, logits_at=torch.tensor([[1]]))
