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
    # TODO 1: sort each row descending (torch.sort returns the values and their vocabulary positions)
    # TODO 2: probabilities of the sorted row; mass_before[j] = sum of the probabilities ranked above j
    # TODO 3: drop a token when mass_before >= top_p; scatter that decision back to vocabulary order
    # TODO 4: return logits with the dropped tokens filled with -inf
    raise NotImplementedError("TODO: exercise ex03_top_p, top-p")
