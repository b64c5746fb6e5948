"""The MoE layer against a plain per-token loop in float64 (forward and gradients, both dispatch paths,
every expert kind, shared expert), the small-batch gathered path against the sorted loop path (and that
it reads nothing back to the host), the routing formulas, the load-balancing loss, and an MoE model
through the KV cache, generate and a training step."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_transformer import TransformerConfig, TransformerLM, generate
from mini_transformer.inference.kv_cache import KVCache
from mini_transformer.model.moe import (
    MoE,
    _grouped_mm_fits,
    dispatch,
    dispatch_gathered,
    grouped_matmul,
    grouped_matmul_loop,
    load_balancing_loss,
    moe_per_token_reference,
    route,
    small_enough_to_gather,
    tokens_per_expert,
)

C = 16


def moe_config(**changes) -> TransformerConfig:
    values = dict(vocab_size=50, d_model=C, n_heads=2, n_layer=2, max_seq_len=32, pos_emb="rope", norm="rmsnorm",
                  ffn="moe", d_ff=24, n_experts=4, n_experts_per_tok=2, bias=False, tie_weights=False)
    return TransformerConfig(**{**values, **changes})


def random_moe(dtype=torch.float64, **changes) -> MoE:
    moe = MoE(moe_config(**changes)).to(dtype)
    with torch.no_grad():  # large router weights: decisive choices, biases off zero
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return moe


VARIANTS = {
    "swiglu top-2 renormalised": dict(),
    "swiglu top-1": dict(n_experts_per_tok=1),
    "gelu experts with biases, top-3 raw": dict(moe_expert_ffn="gelu", bias=True, n_experts_per_tok=3,
                                                moe_norm_topk_prob=False),
    "relu experts, shared expert": dict(moe_expert_ffn="relu", moe_shared_expert_size=20),
    "swiglu, gated shared expert": dict(moe_shared_expert_size=8, moe_shared_expert_gate=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dispatch_equals_per_token_loop_float64(variant):
    moe = random_moe(**VARIANTS[variant])
    x = torch.randn(3, 7, C, dtype=torch.float64, requires_grad=True)
    got = moe(x)
    expected = moe_per_token_reference(moe, x)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, [x, *moe.parameters()], grad_out)
    expected_grads = torch.autograd.grad(expected, [x, *moe.parameters()], grad_out)
    for g, e in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


@settings(max_examples=15, deadline=None)
@given(tokens=st.integers(1, 40), n_experts=st.integers(1, 6), k=st.integers(1, 6), d_out=st.sampled_from([4, 8, 12]))
def test_grouped_matmul_fp32_equals_the_loop_and_plain_matmuls(tokens, n_experts, k, d_out):
    k = min(k, n_experts)
    experts = torch.randint(0, n_experts, (tokens * k,)).sort().values  # rows sorted by expert, some empty
    counts = torch.bincount(experts, minlength=n_experts)
    x = torch.randn(tokens * k, 8)
    weight = torch.randn(n_experts, d_out, 8)
    expected = torch.stack([weight[e] @ x[r] for r, e in enumerate(experts.tolist())]) if len(x) else x[:, :d_out]
    torch.testing.assert_close(grouped_matmul(x, weight, counts), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped_matmul_loop(x, weight, counts), expected, rtol=1e-5, atol=1e-5)


def test_fp32_layer_with_grouped_matmul_matches_float64_reference():
    moe64 = random_moe()
    moe32 = MoE(moe_config()).float()
    assert _grouped_mm_fits(torch.zeros(1, C), moe32.experts.w_down.weight)  # the grouped kernel path
    moe32.load_state_dict({k: v.float() for k, v in moe64.state_dict().items()})
    x = torch.randn(2, 9, C, dtype=torch.float64)
    torch.testing.assert_close(moe32(x.float()).double(), moe_per_token_reference(moe64, x), rtol=1e-5, atol=1e-5)
    moe32(x.float()).square().sum().backward()  # the grouped kernel's backward, against float64 autograd
    moe_per_token_reference(moe64, x).square().sum().backward()
    for (name, p32), p64 in zip(moe32.named_parameters(), moe64.parameters(), strict=True):
        torch.testing.assert_close(p32.grad.double(), p64.grad, rtol=1e-4, atol=1e-4, msg=name)


EXPERT_KINDS = [dict(), dict(bias=True), dict(moe_expert_ffn="gelu", bias=True), dict(moe_expert_ffn="relu")]


@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 8), n_experts=st.integers(1, 8), k=st.integers(1, 8), kind=st.sampled_from(EXPERT_KINDS),
       renormalize=st.booleans())
def test_gathered_dispatch_equals_the_loop_path_float64(tokens, n_experts, k, kind, renormalize):
    """Any shape, not only the decode shapes MoE sends it: forward and every gradient, float64."""
    k = min(k, n_experts)
    moe = random_moe(n_experts=n_experts, n_experts_per_tok=k, moe_norm_topk_prob=renormalize, **kind)
    x = torch.randn(tokens, C, dtype=torch.float64, requires_grad=True)
    weights, experts = route(moe.router(x), k, renormalize)
    got = dispatch_gathered(x, weights, experts, moe.experts)
    expected = dispatch(x, weights, experts, moe.experts)  # float64: grouped_matmul takes its loop over experts
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn_like(got)
    inputs = [x, *moe.experts.parameters(), *moe.router.parameters()]
    got_grads = torch.autograd.grad(got, inputs, grad_out, retain_graph=True)  # the router's graph is shared
    for g, e in zip(got_grads, torch.autograd.grad(expected, inputs, grad_out), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("tokens, gathered", [(1, True), (2, True), (3, False)])
def test_small_batches_take_the_gathered_path_without_a_host_read(tokens, gathered):
    """E = 4, k = 2: up to 2 tokens are gathered where the sorted path would loop over experts (here: the
    meta device, as on CUDA). A meta tensor has a shape and no values, so any read of a value (the loop's
    counts.tolist()) raises: the gathered path runs there, chosen from shapes alone, and the loop path
    cannot (which shows the check would catch a read)."""
    assert small_enough_to_gather(tokens, 2, 4) == gathered
    moe = MoE(moe_config()).to("meta")
    x = torch.randn(1, tokens, C, device="meta")
    if gathered:
        assert moe(x).shape == (1, tokens, C)
    else:
        with pytest.raises(NotImplementedError, match="meta"):
            moe(x)


def test_decode_step_through_the_layer_equals_the_per_token_reference():
    moe = random_moe(moe_shared_expert_size=8, moe_shared_expert_gate=True)
    x = torch.randn(2, 1, C, dtype=torch.float64)  # one decode step of a batch of 2: N*k = 4 = E, gathered
    assert moe._takes_gathered_path(x.view(2, C))
    torch.testing.assert_close(moe(x), moe_per_token_reference(moe, x), rtol=1e-12, atol=1e-12)
    assert not moe.float()._takes_gathered_path(x.view(2, C).float())  # CPU fp32: the grouped kernel, no read


def test_route_softmax_over_all_experts_then_top_k():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    weights, experts = route(logits, 2, renormalize=False)
    assert experts.tolist() == [[0, 2]]
    torch.testing.assert_close(weights[0], probs[[0, 2]])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights[0], probs[[0, 2]] / probs[[0, 2]].sum())
    assert route(logits.bfloat16(), 2, True)[0].dtype == torch.float32  # routing weights in float32


def test_router_logits_are_kept_and_every_token_reaches_k_experts():
    moe = random_moe()
    x = torch.randn(2, 5, C, dtype=torch.float64)
    moe(x)
    assert moe.router_logits.shape == (10, 4)
    counts = tokens_per_expert(moe.router_logits, 2)
    assert counts.sum() == 10 * 2  # dropless: all N*k slots are served
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[0, :3] = False
    assert tokens_per_expert(moe.router_logits, 2, keep).sum() == 7 * 2


def test_load_balancing_loss_is_one_when_balanced_and_larger_when_not():
    # 4 tokens, 4 experts, top-1: each token picks a different expert with equal confidence -> exactly 1
    balanced = torch.eye(4) * 3.0
    torch.testing.assert_close(load_balancing_loss([balanced], 1), torch.tensor(1.0))
    collapsed = torch.tensor([[3.0, 0, 0, 0]]).repeat(4, 1)  # everyone to expert 0
    assert load_balancing_loss([collapsed], 1) > 2.0
    # the mean over layers
    torch.testing.assert_close(load_balancing_loss([balanced, collapsed], 1),
                               (load_balancing_loss([balanced], 1) + load_balancing_loss([collapsed], 1)) / 2)


def test_aux_loss_is_added_in_training_mode_only():
    model = TransformerLM(moe_config(moe_aux_loss_coef=0.5))
    ids = torch.randint(0, 50, (2, 8))
    model.eval()
    _, ce = model(ids, ids)
    model.train()
    _, total = model(ids, ids)
    aux = load_balancing_loss([b.ffn.router_logits for b in model.blocks], 2)
    torch.testing.assert_close(total, ce + 0.5 * aux)
    _, no_aux = TransformerLM(moe_config(moe_aux_loss_coef=0.0)).train()(ids, ids)  # coefficient 0: no term
    assert no_aux.grad_fn is not None


def test_padding_is_left_out_of_the_aux_loss():
    model = TransformerLM(moe_config()).train()
    ids = torch.randint(0, 50, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :5] = 0
    targets = ids.masked_fill(mask == 0, -100)
    _, total = model(ids, targets, attention_mask=mask)
    model.eval()
    _, ce = model(ids, targets, attention_mask=mask)
    aux = load_balancing_loss([b.ffn.router_logits for b in model.blocks], 2, mask.bool())
    torch.testing.assert_close(total, ce + model.config.moe_aux_loss_coef * aux)


def test_moe_model_cached_decode_equals_full_recompute():
    model = TransformerLM(moe_config()).eval()
    ids = torch.randint(0, 50, (2, 12))
    full, _ = model(ids)
    cache = KVCache.for_model(model.config, batch_size=2)
    first, _ = model(ids[:, :8], cache=cache)
    steps = [model(ids[:, t : t + 1], cache=cache)[0] for t in range(8, 12)]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full, rtol=1e-5, atol=1e-5)


def test_generate_with_and_without_cache_agree_on_moe():
    model = TransformerLM(moe_config()).eval()
    idx = torch.randint(0, 50, (2, 5))
    mask = torch.ones_like(idx)
    mask[0, :2] = 0
    assert torch.equal(generate(model, idx, 10, attention_mask=mask),
                       generate(model, idx, 10, attention_mask=mask, use_cache=False))


def test_training_steps_lower_the_loss_and_train_several_experts():
    torch.manual_seed(0)
    model = TransformerLM(moe_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 50, (4, 16))
    losses = []
    for _ in range(30):
        _, loss = model(ids[:, :-1], ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    for block in model.blocks:  # more than one expert learns in every layer
        assert (block.ffn.experts.w_up.weight.grad.flatten(1).abs().sum(1) > 0).sum() >= 2


@pytest.mark.parametrize("change, error, message", [
    (dict(n_experts=0), ValueError, "n_experts=0"),
    (dict(n_experts_per_tok=5), ValueError, "n_experts_per_tok=5 exceeds n_experts=4"),
    (dict(moe_expert_ffn="moe"), ValueError, "moe_expert_ffn='moe'"),
    (dict(moe_shared_expert_size=-1), ValueError, "moe_shared_expert_size=-1"),
    (dict(moe_aux_loss_coef=-0.1), ValueError, "moe_aux_loss_coef=-0.1"),
    (dict(qkv_bias="yes"), TypeError, "qkv_bias='yes'"),
    (dict(head_dim=0), ValueError, "head_dim=0"),
])
def test_bad_moe_and_family_switches_are_named(change, error, message):
    with pytest.raises(error, match=message):
        moe_config(**change)


def test_head_dim_apart_from_d_model():
    cfg = moe_config(ffn="swiglu", d_model=24, n_heads=4, head_dim=8)  # H * D = 32 != C = 24
    model = TransformerLM(cfg)
    assert model.blocks[0].attn.W_o.weight.shape == (24, 32)
    assert model(torch.randint(0, 50, (1, 5)))[0].shape == (1, 5, 50)


def test_padded_grouped_matmul_equals_the_loop():
    """The CUDA path without a grouped kernel (no host read): each expert's rows in their own padded slab."""
    from mini_transformer.model.moe import grouped_matmul_loop, padded_grouped_matmul

    gen = torch.Generator().manual_seed(0)
    experts = torch.tensor([0, 0, 2, 2, 2, 3])  # sorted; expert 1 gets no row
    counts = torch.bincount(experts, minlength=4)
    x = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(4, 5, 8, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(padded_grouped_matmul(x, weight, counts, experts),
                               grouped_matmul_loop(x, weight, counts), atol=1e-12, rtol=0)
