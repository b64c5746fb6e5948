"""Grader for ex06_scheduler_step: one scheduler step, on hand-worked queues (the plan written out below each) and
on 300 random queues, each compared with the plan of the project's own Scheduler on the same state."""

from __future__ import annotations

import random
from typing import NamedTuple

import torch

from mini_transformer.engine.block_manager import BlockManager
from mini_transformer.engine.scheduler import Scheduler
from mini_transformer.engine.sequence import Sequence, SequenceStatus
from mini_transformer.inference.sampling import SamplingParams

EXERCISE = "ex06_scheduler_step"


class S(NamedTuple):  # what the exercise calls SeqState
    name: str
    num_tokens: int
    num_computed_tokens: int


class Plan(NamedTuple):
    scheduled: list
    preempted: list
    waiting_after: list


def blocks_for(n, block_size):
    return -(-n // block_size)


def project_plan(running, waiting, free_blocks, block_size, max_num_seqs, max_num_batched_tokens) -> Plan:
    """The project's Scheduler (engine/scheduler.py) on the same queues: real Sequences holding real blocks."""
    def sequence(state, arrival):
        return Sequence(state.name, [1] * state.num_tokens, SamplingParams(max_tokens=1), (), arrival,
                        torch.device("cpu"))

    held = sum(blocks_for(s.num_computed_tokens, block_size) for s in running)
    manager = BlockManager(held + free_blocks, block_size, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs, max_num_batched_tokens)
    for i, state in enumerate(running):
        seq = sequence(state, i)
        assert manager.allocate_slots(seq, state.num_computed_tokens)
        seq.num_computed_tokens, seq.status = state.num_computed_tokens, SequenceStatus.RUNNING
        scheduler.running.append(seq)
    for i, state in enumerate(waiting):
        scheduler.add(sequence(state, len(running) + i))
    out = scheduler.schedule()
    return Plan([(seq.request_id, n) for seq, n in out.scheduled], [seq.request_id for seq in out.preempted],
                [seq.request_id for seq in scheduler.waiting])


def plan_of(solution, *args) -> Plan:
    got = solution.schedule_step(*args)
    return Plan(list(map(tuple, got.scheduled)), list(got.preempted), list(got.waiting_after))


def test_a_decode_token_and_a_prefill_chunk_share_the_budget(solution):
    # A decodes (1 token); B's 20-token prompt gets the 7 tokens left of the budget of 8: a chunk.
    plan = plan_of(solution, [S("A", 9, 8)], [S("B", 20, 0)], 10, 4, 8, 8)
    assert plan.scheduled == [("A", 1), ("B", 7)], f"decode first, then a chunk of the prompt: {plan.scheduled}"
    assert plan.preempted == [] and plan.waiting_after == []


def test_the_budget_cuts_a_running_prompt_and_admits_nobody(solution):
    plan = plan_of(solution, [S("A", 10, 2)], [S("B", 3, 0)], 10, 4, 8, 4)
    assert plan.scheduled == [("A", 4)], "A may compute 4 of its 8 missing tokens; no budget is left for B"
    assert plan.waiting_after == ["B"]


def test_the_newest_running_sequence_is_preempted_and_nobody_is_admitted(solution):
    # Both cross a block boundary; no block is free. A (oldest) gets B's block; C must not be admitted.
    plan = plan_of(solution, [S("A", 9, 8), S("B", 5, 4)], [S("C", 1, 0)], 0, 4, 8, 16)
    assert plan.preempted == ["B"], f"the NEWEST running sequence is the victim: {plan.preempted}"
    assert plan.scheduled == [("A", 1)], f"A fits once B's block is back: {plan.scheduled}"
    assert plan.waiting_after == ["B", "C"], "the victim goes to the FRONT; a step that preempted admits nobody"


def test_preempting_several_keeps_their_order_at_the_front(solution):
    # A needs 3 more blocks; C then B are preempted (1 block each, then 2): C is preempted first, B ends first.
    plan = plan_of(solution, [S("A", 13, 4), S("B", 9, 8), S("C", 5, 4)], [S("D", 2, 0)], 0, 4, 8, 16)
    assert plan.preempted == ["C", "B"] and plan.scheduled == [("A", 9)]
    assert plan.waiting_after == ["B", "C", "D"], f"the older victim ends up in front: {plan.waiting_after}"


def test_a_sequence_that_cannot_fit_preempts_itself(solution):
    plan = plan_of(solution, [S("A", 5, 4)], [], 0, 4, 8, 16)
    assert plan.scheduled == [] and plan.preempted == ["A"] and plan.waiting_after == ["A"]


def test_the_head_of_the_queue_blocks_everyone_behind_it(solution):
    plan = plan_of(solution, [], [S("X", 12, 0), S("Y", 2, 0)], 2, 4, 8, 16)
    assert plan.scheduled == [], "X needs 3 blocks and 2 are free; Y fits but must not overtake X (FCFS)"
    assert plan.waiting_after == ["X", "Y"]


def test_max_num_seqs_caps_admission(solution):
    plan = plan_of(solution, [S("A", 3, 2), S("B", 3, 2)], [S("C", 2, 0)], 10, 4, 2, 16)
    assert plan.scheduled == [("A", 1), ("B", 1)] and plan.waiting_after == ["C"]


def random_state(rng: random.Random):
    bs = rng.choice((1, 2, 4))
    running = []
    for i in range(rng.randint(0, 4)):
        computed = rng.randint(1, 12)
        running.append(S(f"r{i}", computed + rng.choice((1, 1, rng.randint(1, 10))), computed))
    waiting = [S(f"w{i}", rng.randint(1, 20), 0) for i in range(rng.randint(0, 4))]
    free = rng.randint(0 if running else 1, 8)  # the pool has at least one block
    return running, waiting, free, bs, rng.randint(1, 5), rng.randint(1, 24)


def test_random_queues_match_the_projects_scheduler(solution):
    rng = random.Random(14)
    for _ in range(300):
        state = random_state(rng)
        want, got = project_plan(*state), plan_of(solution, *state)
        assert got == want, f"state {state}:\n  yours   {got}\n  project {want}"
