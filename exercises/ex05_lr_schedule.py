"""Exercise (docs/05 section 4): the learning-rate schedule, linear warmup then cosine decay.

Fill in `lr_at`, then grade it:

    uv run pytest exercises/test_ex05_lr_schedule.py

    step < warmup:               lr = lr_max * (step + 1) / (warmup + 1)
    warmup <= step < decay:      p = (step - warmup) / (decay - warmup)
                                 lr = lr_min + 0.5 * (1 + cos(pi * p)) * (lr_max - lr_min)
    step >= decay:               lr = lr_min
"""

from __future__ import annotations


def lr_at(step: int, lr_max: float, lr_min: float, warmup: int, decay_steps: int) -> float:
    """The learning rate of optimizer step `step` (counted from 0)."""
    # TODO: the three phases above; step 0 already learns, and the end of the decay lands on lr_min
    raise NotImplementedError("TODO: exercise ex05_lr_schedule, lr_at")
