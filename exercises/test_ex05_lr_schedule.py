"""Grader for ex05_lr_schedule: the learning-rate schedule, at hand-computed points and by its shape."""

from __future__ import annotations

import math

EXERCISE = "ex05_lr_schedule"
LR, MIN_LR, WARMUP, DECAY = 1e-3, 1e-4, 10, 110


def lr(solution, step):
    return solution.lr_at(step, LR, MIN_LR, WARMUP, DECAY)


def test_warmup_rises_linearly_from_the_first_step(solution):
    assert math.isclose(lr(solution, 0), LR / 11), "step 0 already trains: lr_max * 1 / (warmup + 1)"
    assert math.isclose(lr(solution, 9), LR * 10 / 11)
    steps = [lr(solution, s) for s in range(WARMUP)]
    assert all(b > a for a, b in zip(steps, steps[1:], strict=False)), "warmup must rise every step"


def test_cosine_starts_at_the_peak_and_halves_at_the_middle(solution):
    assert math.isclose(lr(solution, WARMUP), LR), "the first step after warmup is at lr_max"
    assert math.isclose(lr(solution, 60), (LR + MIN_LR) / 2), "half-way through the decay: the mean of max and min"
    assert math.isclose(lr(solution, 35), MIN_LR + 0.5 * (1 + math.cos(math.pi / 4)) * (LR - MIN_LR))


def test_decay_never_rises_and_ends_at_min_lr(solution):
    steps = [lr(solution, s) for s in range(WARMUP, DECAY + 20)]
    assert all(b <= a + 1e-15 for a, b in zip(steps, steps[1:], strict=False)), "after warmup lr never rises"
    assert lr(solution, DECAY) == MIN_LR and lr(solution, DECAY + 500) == MIN_LR, "from decay_steps on: lr_min"
