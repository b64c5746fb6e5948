"""Grader for ex12_choice_mask: the token mask of a `choice` constraint. References: the project's engine
(engine/structured.py: xgrammar's GrammarMatcher compiled for the choices over the same toy vocabulary,
filled and read back bit by bit) and a plain bit-by-bit packing."""

from __future__ import annotations

import random

import xgrammar as xgr

from mini_transformer.engine.structured import StructuredOutputManager
from mini_transformer.inference.structured import StructuredOutput

EXERCISE = "ex12_choice_mask"
EOS = 0


def project_masks(vocab, choices, path):
    """The engine's mask before each token of `path` (token ids), and after the last: (bool list, words)."""
    matcher = StructuredOutputManager(vocab, len(vocab), EOS).matcher(StructuredOutput(choice=tuple(choices)))
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    for step in range(len(path) + 1):
        matcher.fill_next_token_bitmask(bitmask, 0)
        words = bitmask[0].tolist()
        if len(vocab) % 32:  # xgrammar leaves the padding bits past the vocabulary set; the exercise clears them
            last = words[-1] & ((1 << (len(vocab) % 32)) - 1)
            words[-1] = last - 2**32 if last >= 2**31 else last
        yield [bool((words[t // 32] >> (t % 32)) & 1) for t in range(len(vocab))], words
        if step < len(path):
            assert matcher.accept_token(path[step])


def spell(vocab, text):
    """Token ids spelling `text` one character at a time (every toy vocabulary holds its characters)."""
    return [vocab.index(c) for c in text]


def check_against_project(solution, vocab, choices, target):
    path = spell(vocab, target)
    for step, (expected, words) in enumerate(project_masks(vocab, choices, path)):
        generated = target[:step]
        got = solution.choice_mask(vocab, choices, generated, EOS)
        assert len(got) == len(vocab), "one bool per token"
        wrong = [vocab[t] for t in range(len(vocab)) if bool(got[t]) != expected[t]]
        assert not wrong, f"choices {choices}, generated {generated!r}: wrong for tokens {wrong}"
        assert solution.pack_bitmask(expected) == words, f"bitmask of {generated!r}: expected {words}"


VOCAB = ["<eos>", "y", "e", "s", "n", "o", "t", "r", "d", "a", "ye", "yes", "no!", "es", "ter", "day", "", "yesterday"]


def test_the_first_step_allows_every_token_that_starts_a_choice(solution):
    got = solution.choice_mask(VOCAB, ["yes", "no"], "", EOS)
    assert [VOCAB[t] for t in range(len(VOCAB)) if got[t]] == ["y", "n", "ye", "yes"]


def test_eos_only_when_the_text_is_a_whole_choice(solution):
    got = solution.choice_mask(VOCAB, ["yes", "yesterday"], "yes", EOS)
    assert got[EOS], "'yes' is a whole choice: the output may end here"
    assert got[VOCAB.index("ter")] and got[VOCAB.index("t")], "and it may go on to 'yesterday'"
    assert not solution.choice_mask(VOCAB, ["yes", "yesterday"], "ye", EOS)[EOS], "'ye' is no choice"


def test_a_token_running_past_every_choice_is_refused(solution):
    got = solution.choice_mask(VOCAB, ["no"], "", EOS)
    assert got[VOCAB.index("n")] and not got[VOCAB.index("no!")], "'no!' spans past the end of 'no'"
    assert not got[VOCAB.index("")], "an empty token is never allowed"


def test_masks_equal_the_project_engine_step_by_step(solution):
    check_against_project(solution, VOCAB, ["yes", "no", "yesterday"], "yesterday")
    check_against_project(solution, VOCAB, ["yes", "no", "yesterday"], "no")


def test_random_vocabularies_and_choices_equal_the_project_engine(solution):
    rng = random.Random(0)
    for _ in range(40):
        letters = "abc"
        pieces = {"".join(rng.choice(letters) for _ in range(rng.randint(2, 4))) for _ in range(rng.randint(0, 40))}
        vocab = ["<eos>", *letters, *sorted(pieces)]  # 4 to 44 tokens: one word or two
        choices = sorted({"".join(rng.choice(letters) for _ in range(rng.randint(1, 5))) for _ in range(3)})
        check_against_project(solution, vocab, choices, rng.choice(choices))


def test_pack_bitmask_bit_order_and_sign(solution):
    assert solution.pack_bitmask([True, False, True]) == [0b101]
    assert solution.pack_bitmask([False] * 31 + [True]) == [-(2**31)], "bit 31 set: a negative int32"
    allowed = [t % 3 == 0 for t in range(70)]
    expected = [sum(1 << (t % 32) for t in range(w * 32, min(70, w * 32 + 32)) if allowed[t]) for w in range(3)]
    assert solution.pack_bitmask(allowed) == [w - 2**32 if w >= 2**31 else w for w in expected]
