"""Exercise (docs/10 §4): pipeline schedules by hand — who runs which microbatch when, and the bubble.

Fill in `gpipe_order`, `one_f_one_b_order`, `bubble_fraction`, `simulate` and `peak_in_flight`, then:

    uv run pytest exercises/test_ex10_pipeline_schedule.py

p ranks each hold one stage (rank r = stage r); a batch is cut into M microbatches. An order is the list
of what one rank computes, in sequence: ("F", m) = the forward of microbatch m, ("B", m) = its backward.
  * GPipe: every forward first (m = 0 .. M-1), then every backward (m = 0 .. M-1).
  * 1F1B: rank r first runs p - 1 - r forwards (warm-up; never more than M), then alternates one forward
    and one backward (the backward of the OLDEST microbatch still waiting), then runs the backwards left.
The grader compares your orders with torch.distributed.pipelining's own (ScheduleGPipe, Schedule1F1B).

Dependencies when simulating: ("F", m) on rank r needs ("F", m) done on rank r - 1; ("B", m) on rank r
needs its own ("F", m) and ("B", m) done on rank r + 1 (the last rank: only its own forward).
"""

from __future__ import annotations


def gpipe_order(rank: int, ranks: int, microbatches: int) -> list[tuple[str, int]]:
    """The GPipe order of one rank: [("F", 0), ..., ("F", M-1), ("B", 0), ..., ("B", M-1)]."""
    # TODO 1: all forwards, then all backwards (the same on every rank)
    raise NotImplementedError("TODO: exercise ex10_pipeline_schedule, gpipe_order")


def one_f_one_b_order(rank: int, ranks: int, microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of one rank (see the module docstring)."""
    # TODO 2: enough forwards first that this rank never waits needlessly (how many depends on the rank),
    #         then alternate, then drain; the same order torch.distributed.pipelining's Schedule1F1B runs
    raise NotImplementedError("TODO: exercise ex10_pipeline_schedule, one_f_one_b_order")


def bubble_fraction(ranks: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of the step each rank idles when every stage takes the same time: the fill and drain of
    the pipeline (p - 1 slots) against the whole span; with v stages per rank (interleaved) each slot is
    v times shorter."""
    # TODO 3: idle time as a share of the whole span (work AND idle), for v stages per rank
    raise NotImplementedError("TODO: exercise ex10_pipeline_schedule, bubble_fraction")


def simulate(orders: list[list[tuple[str, int]]], t_forward: float = 1.0, t_backward: float = 2.0) -> list[float]:
    """Run every rank's order with the dependencies above, each action starting as soon as its rank is
    free and its inputs are done; return each rank's idle fraction 1 - busy / span, where the span runs
    from 0 (rank 0's first forward) to the end of the last action on any rank. Raise ValueError if the
    orders wait on each other forever (a deadlock)."""
    # TODO 4: play the orders out in time: an action starts when its rank is free and what it needs from the
    #         neighbouring stages has finished; orders that can never all finish are an error
    raise NotImplementedError("TODO: exercise ex10_pipeline_schedule, simulate")


def peak_in_flight(order: list[tuple[str, int]]) -> int:
    """The most microbatches whose forward has run on this rank and whose backward has not yet: how many
    microbatches of activations the rank holds at its worst moment."""
    # TODO 5: how many microbatches' activations this rank holds at the worst moment
    raise NotImplementedError("TODO: exercise ex10_pipeline_schedule, peak_in_flight")
