"""CUDA graphs for decode-only steps (nano-vllm's capture_cudagraph, vLLM's cudagraph capture sizes).

On a GPU a small model's decode step is a few hundred tiny kernels; launching each costs the host
microseconds, often more than the kernel itself runs (docs/08a §1c). A CUDA graph records the whole forward pass
once and then launches it with ONE call. A graph replays fixed shapes at fixed addresses, so:

  - one graph per batch-size bucket (1, 2, 4, 8, 16, 32, ...): a step of S decode rows runs the
    smallest bucket >= S, its extra rows padding;
  - static input buffers (ids, positions and the attention fields) that every replay reads: a step
    copies its inputs into them (device-to-device), replays, and reads the bucket's static logits;
  - padding rows write their K/V into the pool's scratch block (nobody's) and see one key there;
  - block-table rows are as wide as the longest sequence allowed; columns past a sequence's context
    are never attended, so whatever they hold does not matter.

Prefill steps (and any step with a prompt chunk) run eagerly: their shapes change every step.
"""

from __future__ import annotations

import torch

from ..attention.paged import PagedAttentionMetadata
from .paged_batch import PagedBatch


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int):
        self.runner, self.sizes = runner, capture_sizes(max_num_seqs)
        largest, width, device = self.sizes[-1], runner.block_table.table.shape[1], runner.device
        self.scratch_slot = runner.scratch_block * runner.block_size
        long = dict(dtype=torch.long, device=device)
        self.idx = torch.zeros(1, largest, **long)
        self.positions = torch.zeros(1, largest, **long)
        self.slot_mapping = torch.full((largest,), self.scratch_slot, **long)
        self.context_lens = torch.ones(largest, **long)
        self.block_tables = torch.full((largest, width), runner.scratch_block, **long)
        self.query_start_loc = torch.arange(largest + 1, **long)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # the largest first: the smaller ones reuse its memory pool
                meta = PagedAttentionMetadata(self.slot_mapping[:size], self.block_tables[:size],
                                              self.context_lens[:size], self.query_start_loc[:size + 1],
                                              runner.block_size, (1,) * size, (1,) * size)
                batch = PagedBatch(runner.kv_cache, self.positions[:, :size], meta, runner.attention)
                runner.model.logits(self.idx[:, :size], cache=batch)  # warm up (allocations, autotuning)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.logits[size] = runner.model.logits(self.idx[:, :size], cache=batch)[0]  # (size, V)
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = graph
        torch.cuda.synchronize(device)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(self, idx: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        """idx, positions (1, S) of S decode rows; meta their fields. Returns their logits (S, V)."""
        S, width = idx.shape[1], meta.block_tables.shape[1]
        size = next(s for s in self.sizes if s >= S)
        self.idx[:, :S] = idx
        self.positions[:, :S] = positions
        self.slot_mapping[:S] = meta.slot_mapping
        self.context_lens[:S] = meta.context_lens
        self.block_tables[:S, :width] = meta.block_tables
        self.slot_mapping[S:size] = self.scratch_slot  # padding rows: write into and read the scratch block
        self.context_lens[S:size] = 1
        self.block_tables[S:size, 0] = self.runner.scratch_block
        self.positions[:, S:size] = 0
        self.graphs[size].replay()
        return self.logits[size][:S]
