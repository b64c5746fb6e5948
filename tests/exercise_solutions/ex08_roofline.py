"""Exercise answered by the project's own counting: the model built on the meta device (nothing allocated),
its bytes by benchmarks/_decode_roofline.py (`weight_bytes`, `kv_bytes_per_slot`), its FLOPs by
benchmarks/bench_roofline.py's `step_cost`, the bound as bench_roofline.py's `roofline_rows`
decides it."""

import copy
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from unittest.mock import patch

import torch
import torch.nn as nn

from mini_transformer import TransformerConfig, TransformerLM
from mini_transformer.model import rope

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _decode_roofline import kv_bytes_per_slot  # noqa: E402
from _decode_roofline import weight_bytes as project_weight_bytes  # noqa: E402
from bench_roofline import step_cost  # noqa: E402


@dataclass(frozen=True)
class Model:  # the exercise's Model: the grader builds its models from the module it grades
    vocab_size: int
    d_model: int
    n_layer: int
    n_heads: int
    n_kv_heads: int
    d_ff: int

    @property
    def d_head(self):
        return self.d_model // self.n_heads


DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def config(m) -> TransformerConfig:
    return TransformerConfig(vocab_size=m.vocab_size, d_model=m.d_model, n_layer=m.n_layer, n_heads=m.n_heads,
                             n_kv_heads=m.n_kv_heads, d_ff=m.d_ff, pos_emb="rope", norm="rmsnorm", ffn="swiglu",
                             bias=False, tie_weights=False)


def _empty_tables(length, d_head, theta=0.0):
    return torch.empty(length, d_head), torch.empty(length, d_head)


@cache
def _meta_model(m):
    """Shapes only: on meta, the random draws and the RoPE tables would still take seconds (decomposed op by
    op) for values nobody reads."""
    with (torch.device("meta"), patch.object(nn.init, "normal_", lambda tensor, *a, **k: tensor),
          patch.object(rope, "rope_tables", _empty_tables)):
        return TransformerLM(config(m))


@cache
def _model(m, bytes_per_value):
    return copy.deepcopy(_meta_model(m)).to(DTYPES[bytes_per_value])


def linear_params(m):
    return sum(mod.weight.numel() for mod in _model(m, 4).modules() if isinstance(mod, nn.Linear))


@cache
def weight_bytes(m, bytes_per_value):
    return project_weight_bytes(_model(m, bytes_per_value))


def kv_bytes_per_token(m, bytes_per_value):
    return kv_bytes_per_slot(config(m), bytes_per_value)


def step_flops(m, batch, context):
    return int(step_cost(config(m), batch, context)[0])


def step_bytes(m, batch, context, bytes_per_value):
    return weight_bytes(m, bytes_per_value) + batch * (context + 1) * kv_bytes_per_token(m, bytes_per_value)


def max_tokens_per_s(m, context, bytes_per_value, bandwidth):
    return bandwidth / step_bytes(m, 1, context, bytes_per_value)


def ridge_point(peak_flops, bandwidth):
    return peak_flops / bandwidth


def ridge_batch(m, context, bytes_per_value, peak_flops, bandwidth):
    ridge = ridge_point(peak_flops, bandwidth)
    if step_flops(m, 1, context) / ((context + 1) * kv_bytes_per_token(m, bytes_per_value)) <= ridge:
        return None  # as the batch grows the intensity only approaches FLOPs / K-V bytes of one sequence
    batch = 1
    while step_flops(m, batch, context) / step_bytes(m, batch, context, bytes_per_value) < ridge:
        batch += 1
    return batch
