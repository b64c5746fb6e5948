"""Grader for ex10_pipeline_schedule: the orders against torch.distributed.pipelining's own schedule (its pipeline
order, the "schedule IR" its visualizer draws), the bubble formula against fractions written out, and
the simulation against the formula and against orders that deadlock."""

from __future__ import annotations

from fractions import Fraction

import pytest
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

EXERCISE = "ex10_pipeline_schedule"
CASES = [(2, 2), (2, 5), (3, 3), (3, 6), (4, 4), (4, 7)]  # (ranks, microbatches), M >= p as 1F1B needs


def library_order(schedule_class, rank: int, ranks: int, microbatches: int) -> list[tuple[str, int]]:
    """The library's order for one rank, computed without processes: only the two numbers it reads are set."""
    schedule = schedule_class.__new__(schedule_class)
    schedule._num_stages, schedule._n_microbatches = ranks, microbatches
    names = {"F": "F", "B": "B"}  # FORWARD is "F", FULL_BACKWARD "B"; idle slots and grad reductions dropped
    actions = [a for a in schedule._get_pipeline_order()[rank] if a is not None]
    return [(names[a.computation_type.value], a.microbatch_index) for a in actions if a.computation_type.value in names]


def test_gpipe_order_is_the_librarys(solution):
    for ranks, m in CASES + [(2, 1), (4, 2)]:
        for rank in range(ranks):
            want = library_order(ScheduleGPipe, rank, ranks, m)
            assert solution.gpipe_order(rank, ranks, m) == want, f"GPipe, rank {rank} of {ranks}, M={m}: {want}"


def last_rank_1f1b(microbatches: int) -> list[tuple[str, int]]:
    """The last rank has no warm-up: F0 B0 F1 B1 ... (what Schedule1F1B really runs there; its pipeline
    order for the last rank, torch 2.15, numbers the forwards from 1 to M instead: a slip of the IR only,
    tests/test_parallel_pp.py records the real order on 2 ranks)."""
    return [(kind, m) for m in range(microbatches) for kind in ("F", "B")]


def test_1f1b_order_is_the_librarys(solution):
    for ranks, m in CASES:
        for rank in range(ranks):
            want = library_order(Schedule1F1B, rank, ranks, m) if rank < ranks - 1 else last_rank_1f1b(m)
            assert solution.one_f_one_b_order(rank, ranks, m) == want, f"1F1B, rank {rank} of {ranks}, M={m}: {want}"


def test_bubble_fraction(solution):
    for ranks, m, v in [(2, 1, 1), (2, 8, 1), (4, 4, 1), (4, 16, 1), (2, 4, 2), (4, 8, 2), (1, 3, 1)]:
        want = Fraction(ranks - 1, v * m + ranks - 1)
        assert solution.bubble_fraction(ranks, m, v) == pytest.approx(float(want), abs=1e-12), (ranks, m, v)


def test_simulated_bubble_matches_the_formula(solution):
    for ranks, m in CASES:
        want = (ranks - 1) / (m + ranks - 1)
        for name, schedule_class in (("GPipe", ScheduleGPipe), ("1F1B", Schedule1F1B)):
            orders = [library_order(schedule_class, r, ranks, m) for r in range(ranks)]
            if schedule_class is Schedule1F1B:
                orders[-1] = last_rank_1f1b(m)
            for t_f, t_b in ((1.0, 2.0), (1.0, 1.0)):
                idle = solution.simulate(orders, t_f, t_b)
                assert len(idle) == ranks
                assert idle == pytest.approx([want] * ranks, abs=1e-9), f"{name}, p={ranks}, M={m}: idle {idle}"


def test_simulate_waits_for_the_previous_rank_and_sees_a_deadlock(solution):
    idle = solution.simulate([[("F", 0), ("B", 0)], [("F", 0), ("B", 0)]], 1.0, 1.0)
    assert idle == pytest.approx([0.5, 0.5]), "2 ranks, 1 microbatch: each works 2 of 4 time units"
    with pytest.raises(ValueError):  # rank 0 wants B0 before F1, but rank 1 runs F1 before B0: stuck
        solution.simulate([[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("F", 0), ("B", 0), ("B", 1)]])


def test_1f1b_holds_at_most_p_minus_rank_microbatches(solution):
    for ranks, m in CASES:
        for rank in range(ranks):
            gpipe = library_order(ScheduleGPipe, rank, ranks, m)
            one_f = library_order(Schedule1F1B, rank, ranks, m) if rank < ranks - 1 else last_rank_1f1b(m)
            assert solution.peak_in_flight(gpipe) == m, "GPipe holds every microbatch before its first backward"
            assert solution.peak_in_flight(one_f) == ranks - rank, f"1F1B, rank {rank} of {ranks}, M={m}"
