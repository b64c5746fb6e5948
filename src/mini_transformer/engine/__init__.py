"""The serving engine: paged KV cache, continuous batching, prefix caching, chunked prefill, preemption.

vLLM's names, one small file each:
  sequence.py       Sequence (a request's tokens, status, block table), RequestOutput
  block_manager.py  BlockManager: the block pool, reference counts, the prefix cache (hash chain, LRU)
  scheduler.py      Scheduler: FCFS under a token budget, prefill chunks and decode tokens in one step
  model_runner.py   ModelRunner: the KV pool tensor and one packed forward pass through the same model
  llm_engine.py     LLMEngine: add_request / step / abort / generate / stats
"""

from ..sampling import SamplingParams
from .block_manager import BlockManager
from .llm_engine import LLMEngine
from .model_runner import ModelRunner, PagedBatch
from .scheduler import Scheduler, SchedulerOutput
from .sequence import RequestOutput, Sequence, SequenceStatus

__all__ = ["BlockManager", "LLMEngine", "ModelRunner", "PagedBatch", "RequestOutput", "SamplingParams",
           "Scheduler", "SchedulerOutput", "Sequence", "SequenceStatus"]
