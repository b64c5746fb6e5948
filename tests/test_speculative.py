"""Speculative decoding and prompt lookup: greedy output identical to the target's plain greedy output,
token for token; with sampling, the first two tokens follow the target's distribution (a chi-square
test at ALPHA per test); the acceptance rule alone is exact on random p, q; KVCache.rollback
leaves the cache as if the rejected tokens had never been written."""

import pytest
import torch

from mini_transformer import KVCache, SamplingParams, TransformerConfig, TransformerLM, generate
from mini_transformer.inference.speculative import (
    SpeculativeStats,
    accept_drafts,
    lookup_drafts,
    speculative_generate,
)

# False-alarm rate of each chi-square test. Every draw is fixed by a seed, so a given implementation passes
# or fails the same way on every run; ALPHA bounds the chance that a correct change that consumes the
# generator differently trips a test by bad luck. Nine tests (2 + 5 + 2), Bonferroni: at most 9e-5 for
# the family. Still strict enough: patched in memory to accept with 0.9 p/q, or to draw the replacement
# from p instead of max(p - q, 0), the rule fails at least two of the nine (p as low as 1e-86, 1e-164).
ALPHA = 1e-5


def model(n_layer=2, vocab=32, seed=0, dtype=torch.float64, init_std=0.3, max_seq_len=96) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=vocab, d_model=32, n_heads=4, n_layer=n_layer, d_ff=64,
                            max_seq_len=max_seq_len, pos_emb="rope", norm="rmsnorm", ffn="swiglu",
                            init_std=init_std)
    return TransformerLM(cfg).to(dtype).eval()


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against probabilities; cells expected < 5 are pooled into one."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    statistic = ((obs - exp) ** 2 / exp).sum()
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_the_targets_plain_greedy(k):
    target, draft = model(n_layer=2, seed=0), model(n_layer=1, seed=1)
    idx = torch.randint(0, 32, (1, 7))
    want = generate(target, idx, 40)
    stats = SpeculativeStats()
    got = speculative_generate(target, idx, SamplingParams(max_tokens=40), draft, k, stats=stats)
    assert torch.equal(got, want)
    assert stats.drafted > 0 and stats.rounds < 40  # rounds with accepted drafts made fewer target passes
    assert torch.equal(generate(target, idx, 40, draft_model=draft, num_speculative_tokens=k), want)


def test_a_draft_equal_to_the_target_is_always_accepted():
    target = model()
    idx = torch.randint(0, 32, (1, 4))
    stats = SpeculativeStats()
    got = speculative_generate(target, idx, SamplingParams(max_tokens=21), target, 4, stats=stats)
    assert torch.equal(got, generate(target, idx, 21))
    assert stats.accepted == stats.drafted and stats.rounds == 5  # 4 drafts + 1 bonus per pass: 21 = 4 * 5 + 1


def test_prompt_lookup_greedy_equals_plain_greedy_and_accepts_on_repetition():
    target = model(init_std=0.02)  # small weights: a nearly uniform model that keeps repeating its input
    pattern = torch.randint(0, 32, (1, 6))
    idx = pattern.repeat(1, 4)  # (1, 24): a repetitive prompt
    stats = SpeculativeStats()
    got = speculative_generate(target, idx, SamplingParams(max_tokens=30), "prompt_lookup", 4, stats=stats)
    assert torch.equal(got, generate(target, idx, 30))
    assert torch.equal(generate(target, idx, 30, draft_model="prompt_lookup"), got)


def test_lookup_drafts_copies_what_followed_the_latest_match():
    assert lookup_drafts([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # the later of two matches
    assert lookup_drafts([5, 6, 7, 5], 3) == [6, 7, 5]  # falls back to a 1-gram
    assert lookup_drafts([1, 2, 3], 2) == []


def test_stop_token_ends_the_output_like_generate():
    target, draft = model(seed=0), model(n_layer=1, seed=1)
    idx = torch.randint(0, 32, (1, 5))
    plain = generate(target, idx, 30)
    eos = int(plain[0, 10])
    want = generate(target, idx, 30, eos_token_id=eos)
    got = generate(target, idx, 30, eos_token_id=eos, draft_model=draft, num_speculative_tokens=3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup"])
def test_first_two_tokens_follow_the_targets_distribution(drafter):
    """1500 seeds, temperature 1: the pair (t1, t2) against p(t1) p(t2 | t1) computed from the target by
    plain forward passes. k = 1, so t2 is the bonus token when t1 was an accepted draft and a fresh
    round's token otherwise: both paths of the rule are exercised."""
    vocab, n = 6, 1500
    target = model(vocab=vocab, seed=0, init_std=0.5)
    draft = model(n_layer=1, vocab=vocab, seed=3, init_std=0.5) if drafter == "model" else "prompt_lookup"
    idx = torch.tensor([[1, 2, 3, 1, 2]])  # "3" follows "1 2" in the prompt: prompt lookup drafts it
    with torch.no_grad():
        p1 = torch.softmax(target(idx)[0][0, -1], dim=-1)  # (V,)
        seconds = torch.cat([idx.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)  # (V, T + 1)
        p2 = torch.softmax(target(seconds)[0][:, -1], dim=-1)  # (V, V): row t1
    joint = (p1[:, None] * p2).reshape(-1)  # (V * V,)
    counts = torch.zeros(vocab * vocab)
    for seed in range(n):
        out = speculative_generate(target, idx, SamplingParams(max_tokens=2, temperature=1.0, seed=seed), draft, 1)
        counts[out[0, 0] * vocab + out[0, 1]] += 1
    assert chi_square_p_value(counts, joint) > ALPHA


@pytest.mark.parametrize("seed", range(5))
def test_acceptance_rule_is_exact_for_random_distributions(seed):
    """The rule alone, 4000 draws, one drafted position: the output token ~ p, whatever q is. Fixed seeds,
    not hypothesis': each seed fixes the draws too, so hypothesis searching 10,001 seeds found one of the
    ~10 that failed at the former 1e-3 (seed 535, p = 0.00037) and its database then replayed it on every run."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 5
    p = torch.softmax(torch.randn(2, vocab, generator=gen) * 2, dim=-1)
    q = torch.softmax(torch.randn(1, vocab, generator=gen) * 2, dim=-1)
    counts = torch.zeros(vocab)
    for _ in range(4000):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        n_accepted, nxt = accept_drafts(p, q, [d], gen)
        counts[d if n_accepted == 1 else nxt] += 1
    assert chi_square_p_value(counts, p[0]) > ALPHA


def exact_round_law(p: torch.Tensor, q: torch.Tensor, drafts: list[int]) -> torch.Tensor:
    """The reference, a plain loop: P(n accepted = j and the next token = t), flattened over (j, t).
    Accept draft i with a_i = min(1, p_i(d_i) / q_i(d_i)); the first rejection at j draws from the
    normalised max(p_j - q_j, 0); all k accepted draws from p_k."""
    k, vocab = len(drafts), p.shape[1]
    law = torch.zeros(k + 1, vocab, dtype=torch.float64)
    all_before = 1.0  # P(drafts 0 .. j-1 all accepted)
    for j, d in enumerate(drafts):
        accept = min(1.0, float(p[j, d] / q[j, d]))
        residual = (p[j] - q[j]).clamp(min=0).double()
        law[j] = all_before * (1 - accept) * residual / residual.sum()
        all_before *= accept
    law[k] = all_before * p[k].double()
    return law.reshape(-1)


@pytest.mark.parametrize("seed", [0, 1])
def test_acceptance_rule_with_several_drafts_follows_its_exact_law(seed):
    """accept_drafts on the device (uniforms drawn at once, one read back) against the plain-loop law of
    (n accepted, next token): 4000 rounds of k = 3 drafts, chi-square at false-alarm rate ALPHA."""
    gen = torch.Generator().manual_seed(seed)
    k, vocab = 3, 5
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen), dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen), dim=-1)
    drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
    counts = torch.zeros((k + 1) * vocab)
    for _ in range(4000):
        n_accepted, nxt = accept_drafts(p, q, drafts, gen)
        counts[n_accepted * vocab + nxt] += 1
    assert chi_square_p_value(counts, exact_round_law(p, q, drafts)) > ALPHA


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup"])
def test_sampling_filters_reach_the_drafts_top_k_one_is_greedy(drafter):
    """Speculative sampling filters p and q with sample_next's chain: top_k=1 leaves one token, so even at
    temperature 1 the output is the target's plain greedy output."""
    target = model(n_layer=2, seed=0)
    draft = model(n_layer=1, seed=1) if drafter == "model" else drafter
    idx = torch.randint(0, 32, (1, 7))
    params = SamplingParams(max_tokens=20, temperature=1.0, top_k=1, seed=3)
    assert torch.equal(speculative_generate(target, idx, params, draft, 3), generate(target, idx, 20))


def test_rollback_equals_never_having_written():
    """Write 5 tokens, roll back 3, write 2 others: same logits and state as writing 2 + 2 directly."""
    target = model()
    prompt, rejected, kept = torch.randint(0, 32, (1, 6)), torch.randint(0, 32, (1, 3)), torch.randint(0, 32, (1, 2))
    a, b = (KVCache.for_model(target.config, 1, 20, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        target(prompt, cache=a)
        target(torch.cat([kept, rejected], dim=1), cache=a)
        a.rollback(3)
        target(prompt, cache=b)
        target(kept, cache=b)
        nxt = torch.randint(0, 32, (1, 2))
        torch.testing.assert_close(target(nxt, cache=a)[0], target(nxt, cache=b)[0], rtol=0, atol=1e-12)
    assert a.length == b.length == 10
    assert a.next_position.tolist() == b.next_position.tolist() == [10]
    assert torch.equal(a.key_padding_mask, b.key_padding_mask)


def test_speculative_door_errors():
    target = model()
    idx = torch.randint(0, 32, (1, 3))
    with pytest.raises(ValueError, match="batch size 2"):
        generate(target, idx.repeat(2, 1), 4, draft_model="prompt_lookup")
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        generate(target, idx, 4, draft_model="prompt_lookup", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="draft vocab_size=16"):
        generate(target, idx, 4, draft_model=model(vocab=16))
    with pytest.raises(ValueError, match="draft_model='ngram'"):
        generate(target, idx, 4, draft_model="ngram")
    with pytest.raises(ValueError, match="repetition_penalty"):
        generate(target, idx, 4, draft_model="prompt_lookup", repetition_penalty=1.2)
    with pytest.raises(ValueError, match="compile"):
        generate(target, idx, 4, draft_model="prompt_lookup", compile=True)


def test_sample_cli_speculative_flags_print_the_plain_greedy_text(tmp_path, capsys):
    from mini_transformer.cli import main
    from mini_transformer.tokenizer import CharTokenizer

    tokenizer = CharTokenizer.train("the quick brown fox jumps over the lazy dog")
    vocab = tokenizer.vocab_size
    target, draft = model(vocab=vocab, dtype=torch.float32), model(n_layer=1, vocab=vocab, seed=1, dtype=torch.float32)
    for name, m in (("target", target), ("draft", draft)):
        m.save_pretrained(tmp_path / name)
        tokenizer.save(tmp_path / name)
    args = ["sample", "--checkpoint", str(tmp_path / "target"), "--prompt", "the fox", "--max-new-tokens", "30",
            "--temperature", "0"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--draft-checkpoint", str(tmp_path / "draft"), "--speculative-tokens", "3"]) == 0
    assert capsys.readouterr().out == plain
    assert main([*args, "--prompt-lookup"]) == 0
    assert capsys.readouterr().out == plain
