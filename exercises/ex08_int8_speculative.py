"""Exercise (docs/08b, docs/08c): int8 weight-only quantization, and the acceptance rule of speculative decoding.

Fill in `quantize_int8`, `dequantize_int8` and `accept_drafts`, then grade them:

    uv run pytest exercises/test_ex08_int8_speculative.py

int8, symmetric, per output channel: row n of a weight w (N, K) gets its own scale s[n] = max_k |w[n, k]| / 127
and is stored as q[n, k] = round(w[n, k] / s[n]) in [-127, 127]; w_hat = s[n] * q[n, k]. Rounding moves a
weight by at most half a step, so |w - w_hat| <= s[n] / 2, row by row.

Speculative decoding: a drafter proposed tokens d_0, d_1, ... drawn from its distributions q[0], q[1], ...;
the target's distributions at the same positions are p[0], p[1], ... (and p[k] after the last draft).
Going through the drafts in order: accept d_i with probability min(1, p[i, d_i] / q[i, d_i]); at the first
rejection draw the next token from max(p[i] - q[i], 0), normalised to sum 1, and stop; if all k are
accepted, draw one more token from p[k]. The tokens that come out follow p exactly, whatever q is.
"""

from __future__ import annotations

import torch


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (q (N, K) int8, scales (N,) float32), one symmetric scale per row (output channel).
    A row of zeros must not divide by zero (clamp the scale to a tiny positive number)."""
    # TODO 1: one scale per row, chosen so that the row's largest magnitude lands on the last int8 step
    #         (a row of zeros must not divide by zero)
    # TODO 2: every weight to its NEAREST step, as int8
    raise NotImplementedError("TODO: exercise ex08_int8_speculative, quantize_int8")


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q (N, K) int8, scales (N,)) -> w_hat (N, K) float32."""
    # TODO 3: back to floats with each row's own scale
    raise NotImplementedError("TODO: exercise ex08_int8_speculative, dequantize_int8")


def accept_drafts(p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator: torch.Generator
                  ) -> tuple[int, int]:
    """p (k+1, V) the target's probabilities at each drafted position and after the last; q (k, V) the
    drafter's; drafts the k drafted token ids (d_i was drawn from q[i], so q[i, d_i] > 0).
    Returns (how many drafts were accepted, the token that follows them).
    Draw every random number from `generator` (torch.rand(..., generator=generator), torch.multinomial(...))."""
    # TODO 4: judge the drafts in order with the rule of the page, so that the tokens that come out are
    #         distributed exactly as the target model's; the first rejection ends the step with a token
    #         drawn so that this still holds
    # TODO 5: when every draft is accepted the target still gives one more token
    raise NotImplementedError("TODO: exercise ex08_int8_speculative, accept_drafts")
