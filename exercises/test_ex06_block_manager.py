"""Grader for ex06_block_manager: block allocation and freeing, checked by counting blocks."""

from __future__ import annotations

import random
from types import SimpleNamespace

EXERCISE = "ex06_block_manager"


def new_seq():
    return SimpleNamespace(block_table=[], num_computed_tokens=0)


def test_allocation_rounds_up_to_whole_blocks(solution):
    manager, seq = solution.BlockManager(10, 4), new_seq()
    assert manager.allocate_slots(seq, 5) is True
    assert len(seq.block_table) == 2, "5 tokens in blocks of 4 need 2 blocks"
    assert manager.num_free_blocks == 8


def test_a_new_block_only_when_the_tokens_cross_a_boundary(solution):
    manager, seq = solution.BlockManager(10, 4), new_seq()
    manager.allocate_slots(seq, 5)
    seq.num_computed_tokens = 5  # the engine counts them once the forward pass wrote their K/V
    assert manager.allocate_slots(seq, 1) and len(seq.block_table) == 2, "token 6 still fits in block 2"
    seq.num_computed_tokens = 6
    assert manager.allocate_slots(seq, 3) and len(seq.block_table) == 3, "tokens 7..9 need a third block"
    assert manager.num_free_blocks == 7


def test_too_few_blocks_changes_nothing(solution):
    manager, a, b = solution.BlockManager(3, 4), new_seq(), new_seq()
    assert manager.allocate_slots(a, 8)
    assert manager.allocate_slots(b, 9) is False, "9 tokens need 3 blocks; only 1 is free"
    assert b.block_table == [] and manager.num_free_blocks == 1, "a refused allocation must not take blocks"


def test_sequences_never_share_a_block(solution):
    manager, seqs = solution.BlockManager(12, 2), [new_seq() for _ in range(4)]
    for n, seq in zip((3, 5, 1, 6), seqs, strict=True):
        assert manager.allocate_slots(seq, n)
    ids = [b for seq in seqs for b in seq.block_table]
    assert len(ids) == len(set(ids)) == 2 + 3 + 1 + 3, f"block tables overlap or miscount: {ids}"
    assert all(0 <= b < 12 for b in ids)


def test_free_gives_every_block_back(solution):
    manager, a, b = solution.BlockManager(4, 4), new_seq(), new_seq()
    manager.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    manager.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0, "a freed sequence starts again from nothing"
    assert manager.num_free_blocks == 4
    assert manager.allocate_slots(b, 16) and sorted(b.block_table) == [0, 1, 2, 3], "freed blocks are reusable"


def test_no_block_is_ever_lost(solution):
    rng, manager = random.Random(0), solution.BlockManager(16, 3)
    live = []
    for _ in range(200):
        if live and rng.random() < 0.4:
            manager.free(live.pop(rng.randrange(len(live))))
        else:
            seq = new_seq()
            if manager.allocate_slots(seq, rng.randint(1, 12)):
                live.append(seq)
        held = sum(len(seq.block_table) for seq in live)
        assert held + manager.num_free_blocks == 16, "every block is either free or in exactly one table"
