"""The serving engine: paged KV cache, continuous batching, prefix caching, chunked prefill, preemption.

vLLM's names, one small file each:
  sequence.py       Sequence (a request's tokens, status, block table), RequestOutput
  block_manager.py  BlockManager: the block pool, reference counts, the prefix cache (hash chain, LRU)
  scheduler.py      Scheduler: FCFS under a token budget, prefill chunks and decode tokens in one step;
                    EngineCounters, the counts of what the engine did (the scheduler alone adds to them)
  model_runner.py   ModelRunner: the KV pool tensor and one packed forward pass through the same model
  paged_batch.py    PagedBatch: the model's cache interface over the pool for one step (-> paged attention)
  config.py         EngineConfig: every knob, one frozen dataclass checked once
  block_table.py    BlockTable: each running sequence's block ids in one persistent array
  cuda_graphs.py    DecodeGraphs: decode-only steps replayed as CUDA graphs (GPU)
  sampler.py        Sampler: every row's next token in one batched pass over the logits
  batch_plan.py     BatchPlan: the sampler's per-row parameters (RowParams), built once per batch; the
                    device-side token counts for the penalties (TokenCounts)
  logprobs.py       logprobs and prompt logprobs on the device, and the step's one host read (read_back)
  llm_engine.py     LLMEngine: add_request / step / abort / generate / stats / snapshot
  snapshot.py       EngineSnapshot: a frozen picture of the queues and the pool, for a server
  handoff.py        KVHandoff: a prefilled request moved to another engine (prefill/decode disaggregation);
                    PoolHandoff: the pool's side of it, owned by the engine
  kv_connector.py   KVConnector: full blocks kept behind the pool and shared by replicas (lookup, load, save)
  kv_entry.py       one stored block: its format, the model fingerprint, its MAC (keyed by a shared secret)
  kv_tiers.py       HostTier (an LRU in host memory), RedisTier (a Redis server): where those blocks live
  kv_events.py      KVEventPublisher: the prefix cache's changes as vLLM's KV events, for a KV-aware router
                    (imported on its own: it brings ZeroMQ)
"""

from ..inference.sampling import SamplingParams
from .block_manager import BlockManager
from .config import EngineConfig
from .handoff import KVHandoff
from .kv_connector import KVConnector
from .kv_tiers import HostTier, RedisTier
from .llm_engine import InvalidRequest, LLMEngine
from .model_runner import ModelRunner
from .paged_batch import PagedBatch
from .sampler import Sampler
from .scheduler import EngineCounters, Scheduler, SchedulerOutput
from .sequence import RequestOutput, Sequence, SequenceStatus, TokenLogprob
from .snapshot import EngineSnapshot, EngineStats, RequestSnapshot

__all__ = ["BlockManager", "EngineConfig", "EngineCounters", "EngineSnapshot", "EngineStats", "HostTier",
           "InvalidRequest", "KVConnector", "KVHandoff", "LLMEngine", "ModelRunner", "PagedBatch", "RedisTier",
           "RequestOutput", "RequestSnapshot", "Sampler", "SamplingParams", "Scheduler", "SchedulerOutput",
           "Sequence", "SequenceStatus", "TokenLogprob"]
