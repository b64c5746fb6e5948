"""Expert-parallel MoE on 2 gloo ranks against one process on the whole batch."""

import pytest
import torch

from mini_transformer import TransformerConfig, TransformerLM, generate
from mini_transformer.parallel import run_processes
from mini_transformer.parallel.ep import check_experts_divisible, shard_expert_parallel

# SwiGLU experts + a shared expert; classic GELU experts with biases, 6 experts (3 per rank)
SWIGLU = dict(vocab_size=50, d_model=32, n_heads=4, n_layer=2, max_seq_len=32, ffn="moe", n_experts=4,
              n_experts_per_tok=2, d_ff=32, init_std=0.3, moe_shared_expert_size=16)
GELU = dict(vocab_size=50, d_model=32, n_heads=4, n_layer=2, max_seq_len=32, ffn="moe", n_experts=6,
            n_experts_per_tok=2, d_ff=32, moe_expert_ffn="gelu", bias=True, init_std=0.3)


def build(values: dict) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(**values)).eval()


def batch() -> torch.Tensor:
    return torch.randint(50, (4, 9), generator=torch.Generator().manual_seed(1))  # rank r runs rows 2r, 2r+1


def ep_outputs(rank: int, world_size: int, configs: list[dict]) -> dict:
    out: dict = {"models": []}
    for values in configs:
        model = shard_expert_parallel(build(values))
        rows = batch()[2 * rank: 2 * rank + 2]
        with torch.no_grad():
            logits = model(rows)[0]
        out["models"].append({"logits": logits, "tokens": generate(model, rows, 6),
                              "experts": model.blocks[0].ffn.experts.local.n_experts,
                              "sent": model.collectives.nbytes})
    try:
        shard_expert_parallel(build({**GELU, "n_experts": 5}))
    except ValueError as err:
        out["error"] = str(err)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_processes(ep_outputs, 2, args=([SWIGLU, GELU],), timeout=120)


@pytest.mark.parametrize("which", [0, 1], ids=["swiglu-shared", "gelu-bias"])
def test_expert_parallel_equals_one_process(two_ranks, which):
    values = [SWIGLU, GELU][which]
    model = build(values)
    with torch.no_grad():
        reference = model(batch())[0]
    tokens = generate(model, batch(), 6)
    got = [rank["models"][which] for rank in two_ranks]
    torch.testing.assert_close(torch.cat([g["logits"] for g in got]), reference, rtol=0, atol=1e-5)
    assert torch.equal(torch.cat([g["tokens"] for g in got]), tokens)
    assert all(g["experts"] == values["n_experts"] // 2 for g in got)
    assert all(g["sent"] > 0 for g in got)  # tokens really left their rank


def test_experts_that_do_not_divide_fail_on_every_rank(two_ranks):
    for rank in two_ranks:
        assert "world_size=2 needs n_experts=5 divisible by it" in rank["error"]


def test_check_experts_divisible():
    check_experts_divisible(8, 4)
    with pytest.raises(ValueError, match="n_experts=6"):
        check_experts_divisible(6, 4)


def test_expert_parallel_needs_an_moe_model():
    with pytest.raises(ValueError, match="ffn='moe'"):
        shard_expert_parallel(build({**GELU, "ffn": "gelu"}))
