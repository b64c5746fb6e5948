"""Exercise (docs/06 section 5): one step of the engine's scheduler — token budget, chunked prefill,
preemption, first come first served. No prefix caching here (that is exercise ex06_prefix_cache).

Fill in `schedule_step`, then grade it (the grader also runs the project's own Scheduler on the same
queues and compares the two plans):

    uv run pytest exercises/test_ex06_scheduler_step.py

The state: a sequence has num_tokens tokens (prompt + output so far), of which num_computed_tokens
already have their K/V in the pool, in ceil(num_computed_tokens / block_size) blocks. A waiting sequence
has computed nothing and holds no block (a preempted one starts again from zero). `free_blocks` blocks
are free. The rules, in this order:

  1. RUNNING sequences, oldest first, while budget is left: each asks for min(num_tokens -
     num_computed_tokens, budget) tokens (a decoding one asks for 1; a prompt longer than the budget
     is cut into chunks). Its block table must cover num_computed_tokens + those tokens. While the
     free blocks are too few, preempt the NEWEST running sequence: it gives back all its blocks and goes
     to the FRONT of the waiting queue. If the newest is the sequence itself, it is not scheduled.
  2. Only if nobody was preempted in this step: WAITING sequences in queue order, while budget is left
     and fewer than max_num_seqs sequences run. Each asks for min(num_tokens, budget) tokens. If the free
     blocks cannot hold them, stop: nobody behind it may overtake it. Otherwise it joins the running
     sequences (as the newest).
"""

from __future__ import annotations

from typing import NamedTuple


class SeqState(NamedTuple):
    name: str
    num_tokens: int  # prompt + output tokens so far
    num_computed_tokens: int  # of those, how many have K/V in the pool (0 for a waiting sequence)


class StepPlan(NamedTuple):
    scheduled: list[tuple[str, int]]  # (name, tokens computed in this step), in the order scheduled
    preempted: list[str]  # in the order they were preempted
    waiting_after: list[str]  # the waiting queue after the step, front first


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)  # ceil


def schedule_step(running: list[SeqState], waiting: list[SeqState], free_blocks: int, block_size: int,
                  max_num_seqs: int, max_num_batched_tokens: int) -> StepPlan:
    """The plan of one step. `running` is in admission order (the last is the newest), `waiting` front first."""
    # TODO 1: rule 1: the running sequences within the step's token budget (blocks_for helps with blocks)
    # TODO 2: rule 1's preemption when the free blocks run out: who gives way, where it waits, what it returns
    # TODO 3: rule 2: admit waiting sequences, within every limit; mind when a step admits nobody at all
    raise NotImplementedError("TODO: exercise ex06_scheduler_step, schedule_step")
