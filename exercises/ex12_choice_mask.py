"""Exercise (docs/12 sections 2 and 4): the token mask of a `choice` constraint, and its bitmask.

Fill in `choice_mask` and `pack_bitmask`, then grade them:

    uv run pytest exercises/test_ex12_choice_mask.py

The output must be exactly one of `choices`. `generated` is the text produced so far (always a prefix of
at least one choice). The vocabulary is a list of token strings; `vocab[eos_id]` is the end-of-sequence
token, which adds no text. The rules for the NEXT token t:
  - a text token is allowed when `generated + vocab[t]` is still a prefix of some choice (a token may
    carry several characters: all of them must fit; one that runs past the end of every choice is out);
  - EOS is allowed only when `generated` is already one of the choices (then the output may end);
  - an empty token string is never allowed (it would let the output stall forever).
The grader compares your mask with the project's engine (xgrammar's GrammarMatcher over the same
vocabulary) at every step of many random cases.

`pack_bitmask` then writes the mask the way xgrammar (and our sampler) stores it: 32 tokens per int32
word, token t in word t // 32 at bit t % 32 (bit 0 the lowest), 1 = allowed; the last word is padded
with 0 bits (xgrammar itself leaves them set: apply_token_bitmask_inplace is told the vocabulary size and
never reads them). The words are int32 values, so a word whose bit 31 is set is NEGATIVE.
"""

from __future__ import annotations


def choice_mask(vocab: list[str], choices: list[str], generated: str, eos_id: int) -> list[bool]:
    """One bool per token of `vocab`: may it come next?"""
    # TODO 1: a token is allowed when, whole, it keeps the text on the way to at least one choice (a token
    #         that adds nothing makes no progress)
    # TODO 2: EOS is allowed exactly when stopping now leaves a valid answer
    raise NotImplementedError("TODO: exercise ex12_choice_mask, the choice mask")


def pack_bitmask(allowed: list[bool]) -> list[int]:
    """The mask as ceil(V / 32) int32 words (bit t % 32 of word t // 32 = token t allowed)."""
    # TODO 3: token t's bit goes into the word and position the docstring gives (lowest bit first)
    # TODO 4: the words are int32, so a word with its top bit set is a negative number
    raise NotImplementedError("TODO: exercise ex12_choice_mask, the bitmask")
