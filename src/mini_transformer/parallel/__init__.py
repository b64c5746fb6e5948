"""Parallelism on torch.distributed: tensor-parallel inference (tp.py), expert-parallel MoE inference (ep.py),
FSDP2 training helpers (fsdp.py), prefill/decode disaggregation (pd.py, imported on its own: it needs the
engine), and a launcher that runs a function on N local ranks for tests and benchmarks (launch.py)."""

from .ep import check_experts_divisible, shard_expert_parallel
from .launch import RankFailed, run_processes
from .tp import check_divisible, shard_tensor_parallel

__all__ = ["RankFailed", "check_divisible", "check_experts_divisible", "run_processes", "shard_expert_parallel",
           "shard_tensor_parallel"]
