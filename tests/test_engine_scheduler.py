"""Scheduler: FCFS under max_num_seqs and the token budget, prefill chunks beside decode tokens, the
newest running sequence preempted when the pool runs out, nobody admitted in a step that preempted,
and no starvation. The reference is the rule itself, checked step by step on the plan."""

import torch

from mini_transformer import SamplingParams
from mini_transformer.engine.block_manager import BlockManager
from mini_transformer.engine.scheduler import Scheduler
from mini_transformer.engine.sequence import Sequence, SequenceStatus


def seq(n_prompt, name, max_tokens=8):
    return Sequence(name, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), (), 0,
                    torch.device("cpu"))


def run(scheduler, plan):
    """What the engine does after the forward pass: count the tokens computed, append one sampled token
    to each sequence whose chunk reached its end, finish at max_tokens."""
    for s, n in plan.scheduled:
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(7)
            if s.is_finished:
                scheduler.finish(s)


def test_fcfs_with_max_num_seqs_and_token_budget():
    scheduler = Scheduler(BlockManager(100, 4, False), max_num_seqs=2, max_num_batched_tokens=10)
    a, b, c = seq(6, "a"), seq(3, "b"), seq(2, "c")
    for s in (a, b, c):
        scheduler.add(s)
    plan = scheduler.schedule()
    assert [(s.request_id, n) for s, n in plan.scheduled] == [("a", 6), ("b", 3)]  # c: max_num_seqs
    run(scheduler, plan)
    plan = scheduler.schedule()
    assert [(s.request_id, n) for s, n in plan.scheduled] == [("a", 1), ("b", 1)]
    assert c.status is SequenceStatus.WAITING


def test_a_long_prompt_is_chunked_beside_decode_tokens():
    scheduler = Scheduler(BlockManager(100, 4, False), max_num_seqs=8, max_num_batched_tokens=8)
    a = seq(3, "a")
    scheduler.add(a)
    run(scheduler, scheduler.schedule())
    long = seq(20, "long")
    scheduler.add(long)
    chunks = []
    for _ in range(3):
        plan = scheduler.schedule()
        assert plan.num_batched_tokens <= 8
        assert plan.scheduled[0] == (a, 1)  # the running sequence decodes first, every step
        chunks.append(plan.scheduled[1][1])
        run(scheduler, plan)
    assert chunks == [7, 7, 6] and long.num_computed_tokens == 20 and len(long.output_token_ids) == 1


def test_the_newest_running_sequence_is_preempted_and_goes_back_first():
    manager = BlockManager(5, 4, False)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c, d = seq(4, "a"), seq(4, "b"), seq(4, "c"), seq(2, "d")
    for s in (a, b, c):
        scheduler.add(s)
    run(scheduler, scheduler.schedule())  # 3 blocks, each full: the next token needs a new block
    scheduler.add(d)
    plan = scheduler.schedule()  # a, b take the last two blocks; c cannot: it is preempted, d waits
    assert manager.num_free_blocks == 1  # the one c gave back (d may not take it in this step)
    assert [s.request_id for s, _ in plan.scheduled] == ["a", "b"]
    assert plan.preempted == [c] and c.status is SequenceStatus.WAITING and c.block_table == []
    assert list(scheduler.waiting) == [c, d]  # the victim first, before later arrivals
    assert c.num_computed_tokens == 0 and len(c.output_token_ids) == 1  # its tokens stay, to be recomputed


def test_no_request_starves_behind_a_stream_of_short_ones():
    manager = BlockManager(8, 4, False)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=16)
    big = seq(24, "big", max_tokens=4)  # needs 7 of the 8 blocks
    scheduler.add(seq(3, "first"))
    scheduler.add(big)
    finished, step = [], 0
    while scheduler.has_unfinished() and step < 200:
        if step < 40:
            scheduler.add(seq(3, f"s{step}", max_tokens=6))  # a new short request every step
        plan = scheduler.schedule()
        run(scheduler, plan)
        finished += [s.request_id for s, _ in plan.scheduled if s.is_finished]
        step += 1
    assert not scheduler.has_unfinished()
    assert finished.index("big") < finished.index("s1")  # FCFS: later arrivals did not overtake it
