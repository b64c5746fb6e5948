"""Exercise (docs/03 section 5): top-p (nucleus) filtering of logits.

Fill in `top_p_filter`, then grade it:

    uv run pytest exercises/test_ex03_top_p.py

Rule (the project's and Hugging Face's): sort the tokens by probability, largest first; keep the smallest
set of most likely tokens whose probabilities add up to at least top_p. The token that crosses top_p is
kept, and so is the most likely token, always. Dropped tokens get -inf; kept logits are unchanged.
"""

from __future__ import annotations

import torch


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits (B, V), 0 < top_p <= 1 -> logits (B, V) with the tokens outside the nucleus set to -inf."""
    # TODO 1: rank each row's tokens from the most to the least likely
    # TODO 2: keep tokens in that order until the kept probability reaches top_p; the token that crosses
    #         top_p stays, and the most likely token always stays
    # TODO 3: the other tokens get logit -inf, each in its own vocabulary position
    raise NotImplementedError("TODO: exercise ex03_top_p, top-p")
