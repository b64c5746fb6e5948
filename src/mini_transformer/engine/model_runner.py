"""ModelRunner: the KV pool, and one forward pass over the packed tokens of every scheduled sequence.

The pool is ONE tensor for all layers, (2, n_layer, (num_blocks + 1) * block_size, Hkv, D): k and v,
then the layer, then the slot. One block id therefore names the same slots in every layer, so the
BlockManager hands out a block once for the whole model, memory is claimed in one allocation, and each
layer's part is a view (`kv_cache[0, layer]`). Slots of one block are adjacent (slot = block_id *
block_size + offset). The extra last block is nobody's: the padding rows of a CUDA-graph batch write there.

A step packs the new tokens of all scheduled sequences into ONE row, idx (1, N), with no padding, and
runs the same `TransformerLM` on it. The model sees a `PagedBatch` (paged_batch.py) through the cache
interface (`begin` -> positions, `attend` -> write K/V through the slot mapping, then paged attention).

The step's inputs are built on the host from Python lists and numpy (block tables from the persistent
`BlockTable`), and reach the device in two copies (ids/positions/logit rows, and the attention metadata),
pinned and non_blocking on CUDA. On CUDA a decode-only step replays a captured CUDA graph (cuda_graphs.py)
unless `enforce_eager`. The paged attention is chosen once, here (`self.attention`): on the CPU its decode
is the C++ paged kernel (attention/paged_cpu.py), on the `triton` backend the Triton kernel. On the CPU at
fp32 the model's Linears are packed for oneDNN (model/packed_linear.py) unless `pack_linear_weights=False`:
a step's few dozen rows through a weight cost far less than through `aten::mm`.
"""

from __future__ import annotations

import numpy as np
import torch

from ..attention.paged import PagedAttention, PagedAttentionMetadata, paged_attention_for
from ..config import TransformerConfig
from ..model.packed_linear import pack_linears
from ..model.transformer import Attend, TransformerLM
from .block_table import BlockTable
from .cuda_graphs import DecodeGraphs
from .logprobs import PromptLogprobs, read_back
from .paged_batch import PagedBatch
from .sampler import Sampler
from .sequence import Sequence


def bytes_per_block(cfg: TransformerConfig, block_size: int, dtype: torch.dtype) -> int:
    """2 (k and v) * n_layer * block_size * Hkv * D * bytes per element."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.n_layer * block_size * cfg.n_kv_heads * cfg.d_head * element


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array onto the device: through page-locked memory and non_blocking on CUDA, so the host
    goes on building while the copy runs (from pageable memory the copy would make the host wait)."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class ModelRunner:
    def __init__(self, model: TransformerLM, num_blocks: int, block_size: int, max_num_seqs: int = 64,
                 enforce_eager: bool = False, pack_linear_weights: bool = True):
        cfg = model.config
        weight = model.tok_emb.weight
        if pack_linear_weights and weight.device.type == "cpu" and weight.dtype == torch.float32:
            pack_linears(model)  # in place over the same parameters: the model stays one model
        self.model, self.block_size = model, block_size
        assert all(m.backend == cfg.attn_backend for m in model.modules() if isinstance(m, Attend)), \
            "every layer must attend with the configured backend: the paged attention is chosen once"
        self.device, self.dtype = weight.device, weight.dtype
        self.attention = self.paged_attention(cfg.attn_backend, enforce_eager)
        shape = (2, cfg.n_layer, (num_blocks + 1) * block_size, cfg.n_kv_heads, cfg.d_head)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.scratch_block = num_blocks  # the pool's extra block: no sequence ever owns it
        self.block_table = BlockTable(-(-cfg.max_seq_len // block_size), rows=max_num_seqs)
        self.graphs = None
        if self.device.type == "cuda" and not enforce_eager:
            self.graphs = DecodeGraphs(self, max_num_seqs)
        self.sampler = Sampler(cfg.vocab_size, self.device)

    def paged_attention(self, backend: str, enforce_eager: bool) -> PagedAttention:
        """The pool's paged attention, chosen once: the Triton kernel walks the block tables itself for every
        kind of row; every other backend gets attention/paged.py's (decode on the CPU through the C++ kernel,
        prefill rows gathered, then through the model's backend)."""
        if backend == "triton":  # imported on demand: it needs the triton package, and importing it is slow
            from ..attention.triton_paged import TritonPagedAttention

            return TritonPagedAttention()
        return paged_attention_for(self.device, self.dtype, enforce_eager)

    def slots(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """(num_tokens,) the pool slots of a sequence's tokens 0 .. num_tokens-1, on the pool's device."""
        bs = self.block_size
        return torch.tensor([block_table[i // bs] * bs + i % bs for i in range(num_tokens)], device=self.device)

    # copy_kv_out / copy_kv_in move a whole prefix through its block table, all layers at once (a PD
    # handoff); paged.write_kv is the per-layer scatter of one step's new tokens through the slot mapping.
    def copy_kv_out(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """A copy of the K/V of a sequence's first num_tokens tokens: (2, n_layer, num_tokens, Hkv, D)."""
        return self.kv_cache[:, :, self.slots(block_table, num_tokens)].contiguous()  # dist.send needs contiguous

    def copy_kv_in(self, block_table: list[int], kv: torch.Tensor) -> None:
        """Put K/V (2, n_layer, P, Hkv, D) into the slots of a sequence's tokens 0 .. P-1."""
        self.kv_cache[:, :, self.slots(block_table, kv.shape[2])] = kv.to(self.device)

    def release(self, request_id: str) -> None:
        """A request left the engine: free its row of the persistent block table."""
        self.block_table.release(request_id)

    def prepare(self, scheduled: list[tuple[Sequence, int]], extra_rows: list[int]):
        """The step's inputs, on the device: idx (1, N), positions (1, N), the rows whose logits are
        wanted (M sampled rows, then `extra_rows`: prompt-logprob rows), the attention metadata; plus, per
        pair, whether it samples (host)."""
        input_ids: list[int] = []
        last_rows: list[int] = []  # row of the packed batch whose logits pick each sampling sequence's token
        samples: list[bool] = []  # per pair: does this chunk reach the sequence's last token?
        context_lens, query_lens = [], []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            input_ids += seq.tokens_between(start, start + n)
            context_lens.append(start + n)
            query_lens.append(n)
            samples.append(start + n == seq.num_tokens)
            if samples[-1]:
                last_rows.append(len(input_ids) - 1)
        ctx, new = np.asarray(context_lens), np.asarray(query_lens)
        first = ctx - new - (np.cumsum(new) - new)  # per pair: its first position minus its first packed row
        positions = np.repeat(first, new) + np.arange(new.sum())  # (N,), no Python loop over the pairs
        rows_of_seqs = self.block_table.rows_for([seq for seq, _ in scheduled])  # first: it may grow the table
        tables = self.block_table.table[rows_of_seqs]
        meta = PagedAttentionMetadata.build(tables, context_lens, query_lens, self.block_size, self.device)
        N = len(input_ids)
        rows = np.asarray(last_rows + list(extra_rows), dtype=np.int64)
        packed = to_device(np.concatenate([np.asarray(input_ids), positions, rows]), self.device)
        idx, pos, rows = packed.split([N, N, len(rows)])
        return idx.view(1, N), pos.view(1, N), rows, meta, samples

    def forward(self, idx, positions, rows, meta, graphable: bool = True) -> torch.Tensor:
        """(len(rows), V) logits at `rows`: a captured CUDA graph for a decode-only step that fits one (its
        rows are all the tokens, in order), else eager."""
        if graphable and self.graphs is not None and meta.is_decode_only and self.graphs.fits(idx.shape[1]):
            return self.graphs.run(idx, positions, meta)
        batch = PagedBatch(self.kv_cache, positions, meta, self.attention)
        logits = self.model.logits(idx, cache=batch, logits_at=rows)  # (1, M, V): sampled rows only
        return logits[0]

    def execute_model(self, scheduled: list[tuple[Sequence, int]]) -> list[int | None]:
        """One forward pass for the scheduled (sequence, num_new_tokens) pairs. Returns, per pair, the
        sampled next token, or None when the chunk does not reach the sequence's last token (its prefill
        goes on next step). The sampled ids (and the logprobs asked for) are read back to the host once,
        together; logprobs go onto their sequences (engine/logprobs.py)."""
        prompt = PromptLogprobs.of(scheduled)  # prompt rows get the head only when a request asks for them
        idx, positions, rows, meta, samples = self.prepare(scheduled, prompt.rows)
        samplers = [seq for (seq, _), sampled in zip(scheduled, samples, strict=True) if sampled]
        self.sampler.grammar.prepare(samplers)  # constrained rows: their masks fill on a worker during the forward
        logits = self.forward(idx, positions, rows, meta, graphable=not prompt.rows)  # (M + R, V)
        M = len(samplers)
        out = self.sampler.sample(logits[:M], samplers) if samplers else None
        if prompt.rows:
            prompt.compute(logits[M:])
        tokens = iter(read_back(out, samplers, prompt))  # the one host read
        return [next(tokens) if sampled else None for sampled in samples]
