"""BlockTable: every running sequence's block ids, kept in one persistent array (vLLM v1's BlockTable).

A sequence's block table only grows while it runs (a block appended when its tokens cross a block
edge), and starts over when it is preempted and admitted again. So instead of padding every table into
a new tensor each step, each sequence keeps a ROW of one (rows, max_blocks) numpy array: a step writes
the blocks added since the last step, then takes the rows of the scheduled sequences in one indexing
operation. Unused columns hold block 0; attention never reads past a sequence's context length.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, max_blocks_per_seq: int, rows: int = 64):
        self.table = np.zeros((rows, max_blocks_per_seq), dtype=np.int64)
        self.free_rows = list(range(rows - 1, -1, -1))
        self.row_of: dict[str, int] = {}  # request id -> its row
        self.source: dict[str, tuple[list[int], int]] = {}  # request id -> (its block list, blocks written)

    def rows_for(self, seqs) -> np.ndarray:
        """Bring each sequence's row up to date with its `block_table` list; return their row numbers."""
        return np.array([self._sync(seq.request_id, seq.block_table) for seq in seqs])

    def _sync(self, request_id: str, blocks: list[int]) -> int:
        row = self.row_of.get(request_id)
        if row is None:
            row = self.row_of[request_id] = self._take_row()
        known, written = self.source.get(request_id, (None, 0))
        if known is not blocks:  # a new list: admitted (again) since its last step, write it whole
            written = 0
        if written < len(blocks):
            self.table[row, written:len(blocks)] = blocks[written:]
        self.source[request_id] = (blocks, len(blocks))
        return row

    def _take_row(self) -> int:
        if not self.free_rows:  # more live sequences than rows (PD handoffs bypass max_num_seqs): grow
            old = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.free_rows = list(range(2 * old - 1, old - 1, -1))
        return self.free_rows.pop()

    def release(self, request_id: str) -> None:
        """The request has left the engine: its row goes back to the free rows."""
        row = self.row_of.pop(request_id, None)
        self.source.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)
