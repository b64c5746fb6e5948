"""Exercise (docs/06): the paged KV cache's block manager, allocate and free (no prefix caching).

Fill in `allocate_slots` and `free`, then grade them:

    uv run pytest exercises/test_ex06_block_manager.py

The pool has num_blocks blocks of block_size token slots. A sequence's block_table lists, in order, the
blocks that hold its tokens; seq.num_computed_tokens says how many of its tokens already have K/V there.
A sequence only ever holds whole blocks, and at most its last one is partly filled.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # take from the left, give back on the right

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def allocate_slots(self, seq, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens after seq's num_computed_tokens.

        Append free blocks to seq.block_table until ceil((num_computed_tokens + num_new_tokens) / block_size)
        blocks are there. If the pool has too few free blocks, change nothing and return False.
        """
        # TODO 1: how many more blocks the sequence needs (a partly filled block is still a block)
        # TODO 2: a request the pool cannot meet changes nothing at all
        # TODO 3: otherwise hand the sequence that many free blocks
        raise NotImplementedError("TODO: exercise ex06_block_manager, allocate_slots")

    def free(self, seq) -> None:
        """Give all of seq's blocks back to the pool; its block_table becomes [] and num_computed_tokens 0
        (a preempted sequence is recomputed from scratch later)."""
        # TODO 4: afterwards the pool holds every block again and the sequence owns nothing
        raise NotImplementedError("TODO: exercise ex06_block_manager, free")
