"""Prefill/decode disaggregation on 2 gloo ranks against one LLMEngine."""

import pytest
import torch

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM
from mini_transformer.engine import EngineConfig, InvalidRequest, LLMEngine
from mini_transformer.parallel import run_processes
from mini_transformer.parallel.pd import kv_bytes_formula, run_disaggregated

LLAMA_GQA = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layer=2, max_seq_len=64, pos_emb="rope",
                 norm="rmsnorm", ffn="swiglu", d_ff=64, bias=False, tie_weights=False, init_std=0.3)
PROMPTS = [[5, 9, 2, 7, 1], list(range(3, 23)), [int(t) for t in torch.arange(33) * 7 % 64]]  # 5, 20, 33 tokens
PARAMS = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=3),
          SamplingParams(max_tokens=1)]  # greedy; seeded sampling (the generator state travels); prefill only


def build() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(**LLAMA_GQA)).eval()


def serve(rank: int, world_size: int) -> list:
    return [run_disaggregated(build(), PROMPTS, params, EngineConfig(block_size=4, num_blocks=64)) for params in PARAMS]


@pytest.fixture(scope="module")
def two_ranks():
    return run_processes(serve, 2, timeout=120)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["greedy", "seeded-sampling", "max-tokens-1"])
def test_disaggregated_equals_one_engine(two_ranks, which):
    engine = LLMEngine(build(), EngineConfig(block_size=4, num_blocks=64))
    reference = engine.generate(PROMPTS, PARAMS[which], use_tqdm=False)
    assert two_ranks[1][which].completions == reference


def test_bytes_moved_match_the_formula(two_ranks):
    model = build()
    expected = [kv_bytes_formula(model, len(p)) for p in PROMPTS]
    for rank in two_ranks:
        assert rank[0].kv_bytes == expected  # 2 * n_layer * P * Hkv * D * 4 bytes per request
        assert rank[2].kv_bytes == [0, 0, 0]  # a request done at its first token sends no K/V


def test_needs_two_ranks():
    with pytest.raises(ValueError, match="exactly 2 ranks"):
        run_disaggregated(build(), PROMPTS, PARAMS[0])


def test_a_bad_prompt_is_refused_before_any_message():
    """Both ranks check every prompt before they talk: a prompt only the prefill rank refused would leave
    the decode rank waiting for its header. No group here, so the check must come first."""
    with pytest.raises(InvalidRequest, match="max_seq_len"):
        run_disaggregated(build(), [PROMPTS[0], list(range(60))], PARAMS[0])
