"""BlockManager: a fixed pool of KV blocks, reference counts, block tables and the prefix cache.

The pool has `num_blocks` blocks of `block_size` token slots. A sequence's block table lists the blocks
that hold its tokens in order; it grows by one block whenever its tokens cross a block boundary, so a
sequence never holds more than one partly filled block (the waste vLLM measured under 4%).

Prefix caching. A FULL block is named by a hash that chains its parent's hash and its own token ids:

    hash(block i) = hash((hash(block i-1), token ids of block i))

so equal hashes mean equal whole prefixes, not just equal blocks. `hash_to_block_id` maps a hash to the
block that holds those tokens' K/V. A new sequence walks its prompt block by block and reuses every
block it finds. A hash can collide, so a hit is checked exactly (the guard): the block must hold the
same token ids, and it must have been computed after the very block matched just before it (its
parent, still holding the same content: each block counts how often it was reallocated). By induction
the whole prefix is then equal, whatever the hash function does.

Blocks are registered in the cache when they are SCHEDULED to be filled, before the forward pass (as
vLLM V1 does): every layer writes its K/V before it attends, so a second sequence in the same step can
already share the block. Freed blocks keep their contents and hash; the free list is ordered by when a
block was freed, and allocation takes the oldest one: least-recently-used eviction. A cache hit on a
free block takes it off the free list again. A shared block (ref_count > 1) is freed only when the last
sequence lets go.

Cache events. While `events` is a list (engine/kv_events.py sets it), every change of the prefix cache is
appended to it: ("stored", parent_hash, hashes, token_ids) for a run of blocks entered in one go,
("removed", hashes) for blocks that leave it, ("cleared",) for a reset. A router reads them to learn what
this pool holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

from .sequence import Sequence


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The chained hash of one full block. Python's tuple hash: fast, deterministic for ints, and free to
    collide — which is why a hit also compares token ids (tests replace this with a constant)."""
    return hash((parent_hash, token_ids))


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "parent", "parent_generation", "generation")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.generation = 0  # how many times the block was handed out: a stale parent link shows
        self.forget()

    def forget(self) -> None:
        self.block_hash: int | None = None  # set while the block is in the prefix cache
        self.token_ids: tuple[int, ...] | None = None  # what it holds, for the collision guard
        self.parent: Block | None = None  # the block holding the tokens just before (None: the first block)
        self.parent_generation = 0

    def follows(self, parent: Block | None) -> bool:
        """Were this block's K/V computed right after `parent`'s current content?"""
        return self.parent is parent and (parent is None or self.parent_generation == parent.generation)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)  # ceil


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.hash_to_block_id: dict[int, int] = {}
        self.peak_blocks_in_use = 0
        self.events: list[tuple] | None = None  # the cache's changes since the last drain_events (None: off)

    # ------------------------------------------------------------------------------- accounting
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_blocks_in_use(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    @property
    def num_shared_blocks(self) -> int:
        return sum(block.ref_count > 1 for block in self.blocks)

    # ------------------------------------------------------------------------------ prefix cache
    def block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """The hash chain of seq's first `num_full_blocks` blocks (extended and kept on the sequence:
        tokens are only ever appended, so a hash never changes)."""
        bs, tokens = self.block_size, None
        while len(seq.block_hashes) < num_full_blocks:
            tokens = seq.tokens if tokens is None else tokens
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else None
            seq.block_hashes.append(hash_block_tokens(parent, tuple(tokens[i * bs:(i + 1) * bs])))
        return seq.block_hashes[:num_full_blocks]

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """The longest run of seq's leading full blocks already in the pool. Only blocks inside the first
        num_tokens - 1 tokens count, so a fully cached prompt still computes (at least) its last token:
        the step needs that token's logits. A request that still needs its prompt logprobs finds nothing
        (as in vLLM): the cache holds K/V, not the logits of the prompt rows."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        bs, tokens = self.block_size, seq.tokens
        hits: list[int] = []
        for i, block_hash in enumerate(self.block_hashes(seq, (seq.num_tokens - 1) // bs)):
            block_id = self.hash_to_block_id.get(block_hash)
            if block_id is None:
                break
            block, parent = self.blocks[block_id], self.blocks[hits[-1]] if hits else None
            if block.token_ids != tuple(tokens[i * bs:(i + 1) * bs]) or not block.follows(parent):
                break  # a hash collision, caught by the guard
            hits.append(block_id)
        return hits

    def _register_full_blocks(self, seq: Sequence, num_tokens_after_step: int) -> None:
        """Enter the blocks that this step fills into the prefix cache (unless an equal block is there)."""
        first, last = seq.num_computed_tokens // self.block_size, num_tokens_after_step // self.block_size
        if not self.enable_prefix_caching or first >= last:
            return
        hashes, tokens, bs = self.block_hashes(seq, last), seq.tokens, self.block_size
        entered = []
        for i in range(first, last):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and hashes[i] not in self.hash_to_block_id:
                block.block_hash, block.token_ids = hashes[i], tuple(tokens[i * bs:(i + 1) * bs])
                if i:
                    block.parent = self.blocks[seq.block_table[i - 1]]
                    block.parent_generation = block.parent.generation
                self.hash_to_block_id[hashes[i]] = block.block_id
                entered.append(i)
        if self.events is not None and entered:
            self._note_stored(hashes, tokens, entered)

    def _note_stored(self, hashes: list[int], tokens: list[int], entered: list[int]) -> None:
        """One "stored" event per run of consecutive blocks: each names its parent by the hash of the block
        just before it, so a reader can chain the runs into prefixes."""
        bs, start = self.block_size, 0
        for k in range(1, len(entered) + 1):
            if k == len(entered) or entered[k] != entered[k - 1] + 1:
                i, j = entered[start], entered[k - 1] + 1
                self.events.append(("stored", hashes[i - 1] if i else None, hashes[i:j], tokens[i * bs:j * bs]))
                start = k

    def _uncache(self, block: Block) -> None:
        """Take a block out of the prefix cache (evicted, reused, or its contents untrusted)."""
        if self.hash_to_block_id.get(block.block_hash) == block.block_id:
            del self.hash_to_block_id[block.block_hash]
            if self.events is not None:
                self.events.append(("removed", [block.block_hash]))
        block.forget()

    def drain_events(self) -> list[tuple]:
        """The cache events since the last call, oldest first (and the list starts afresh)."""
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (new weights make old K/V wrong). Refused (False) while a sequence
        holds blocks: their tables point into the cache."""
        if self.num_blocks_in_use:
            return False
        for block in self.blocks:
            block.forget()
        self.hash_to_block_id.clear()
        if self.events is not None:
            self.events.append(("cleared",))
        return True

    # -------------------------------------------------------------------------------- allocation
    def can_admit(self, seq: Sequence, cached_blocks: Seq[int], num_new_tokens: int) -> bool:
        """Would the pool hold a new sequence that reuses `cached_blocks` and computes num_new_tokens more?"""
        revived = sum(self.blocks[b].ref_count == 0 for b in cached_blocks)  # they leave the free list
        needed = blocks_for(len(cached_blocks) * self.block_size + num_new_tokens, self.block_size)
        return needed - len(cached_blocks) + revived <= self.num_free_blocks

    def admit(self, seq: Sequence, cached_blocks: Seq[int]) -> None:
        """Start seq's block table with the blocks found in the prefix cache: their tokens count as computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = list(cached_blocks)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached_blocks) * self.block_size
        self._note_peak()

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table so that num_new_tokens more tokens fit; False (and nothing changed) if
        the pool has too few free blocks. The blocks these tokens fill enter the prefix cache."""
        total = seq.num_computed_tokens + num_new_tokens
        needed = blocks_for(total, self.block_size) - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        self._register_full_blocks(seq, total)
        self._note_peak()
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)  # the least recently freed
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict it from the prefix cache
            self._uncache(block)
        block.generation += 1
        block.ref_count = 1
        return block_id

    def forget_uncomputed(self, seq: Sequence) -> None:
        """Take the blocks seq was about to fill out of the prefix cache (they were registered when
        scheduled): after a failed forward pass their contents cannot be trusted."""
        for block_id in seq.block_table[seq.num_computed_tokens // self.block_size:]:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._uncache(block)

    def free(self, seq: Sequence) -> None:
        """Let go of seq's blocks. The last block goes on the free list first, so a sequence's tail is
        evicted before its head (heads are what other prompts share). A block that holds no cached
        content goes to the very front: it is the first to be reused."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, block_id
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.block_hash is None:
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _note_peak(self) -> None:
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.num_blocks_in_use)
