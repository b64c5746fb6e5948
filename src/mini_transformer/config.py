"""TransformerConfig: every size and every switch of the model, validated in one place."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, get_args

from ._checks import boolean, choice, integer, number, positive_int, positive_number, probability

PosEmb = Literal["learned", "rope", "sinusoidal", "none"]
Norm = Literal["layernorm", "rmsnorm"]
NormPosition = Literal["pre", "post"]  # pre (GPT-2, Llama) | post (the 2017 paper)
Ffn = Literal["gelu", "gelu_tanh", "relu", "swiglu", "moe"]
ExpertFfn = Literal["gelu", "gelu_tanh", "relu", "swiglu"]  # what each expert of an ffn="moe" layer is
AttnBackend = Literal["naive", "sdpa", "tiled", "triton"]
# the allowed values, read from the types above (one list to keep)
POS_EMBS, NORMS, NORM_POSITIONS, FFNS, ATTN_BACKENDS = map(get_args, (PosEmb, Norm, NormPosition, Ffn, AttnBackend))
EXPERT_FFNS = get_args(ExpertFfn)


def llama_ffn_size(d_model: int, multiple_of: int) -> int:
    """Llama's SwiGLU width: 2/3 of 4*d_model, rounded up to a multiple of `multiple_of`.

    Three projections of width 8/3*d instead of two of width 4*d keep the parameter count equal.
    """
    hidden = int(2 * (4 * d_model) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def small_init_std(d_model: int) -> float:
    """The std of the initial weights: sqrt(2 / (5 * d_model)), the "small init" of Nguyen & Salazar (2019),
    also GPT-NeoX's default.

    It gives 0.023 at GPT-2's width (768), where GPT-2 used a fixed 0.02, and 0.056 at d_model 128. A fixed
    0.02 at d_model 128 makes each linear layer shrink its input (d * std^2 = 0.05, not ~0.4), and the
    nanoGPT CPU run ends ~0.15 nats higher after 2000 steps (docs/05-training.md has the measurements).
    """
    return math.sqrt(2.0 / (5.0 * d_model))


class DictIO:
    """to_dict / from_dict for a config dataclass; unknown names are an error, not silently dropped."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{cls.__name__} has unknown fields {unknown}; expected names among {sorted(known)}")
        return cls(**values)


@dataclass
class TransformerConfig(DictIO):
    """Sizes and switches of a decoder-only Transformer.

    Defaults are GPT-2 small's sizes. `d_ff=None` means 4*d_model (or Llama's 8/3 rule for SwiGLU);
    `n_kv_heads=None` means n_heads (plain multi-head attention); `init_std=None` scales the initial
    weights with the width (see `small_init_std`).
    """

    vocab_size: int = 50257
    d_model: int = 768
    n_heads: int = 12
    d_ff: int | None = None
    n_layer: int = 12
    max_seq_len: int = 1024
    n_kv_heads: int | None = None  # GQA when < n_heads, MQA when 1
    pos_emb: PosEmb = "learned"
    rope_theta: float = 10000.0
    norm: Norm = "layernorm"
    norm_eps: float = 1e-5
    norm_position: NormPosition = "pre"
    ffn: Ffn = "gelu"
    ffn_multiple_of: int = 256  # SwiGLU width rounding when d_ff is not given
    attn_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    embd_pdrop: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    attn_backend: AttnBackend = "naive"
    init_std: float | None = None  # None = sqrt(2 / (5 * d_model)), see small_init_std
    # --- switches the model families of Hugging Face need (Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE) ---
    head_dim: int | None = None  # None = d_model // n_heads; Qwen3 sets it apart (then W_o maps H*D -> C)
    qkv_bias: bool | None = None  # bias on the q/k/v projection; None = follow `bias` (Qwen2: True, bias False)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Qwen3-MoE)
    # --- Mixture of Experts (ffn="moe"): d_ff is each expert's width ---
    n_experts: int = 8
    n_experts_per_tok: int = 2  # top-k
    moe_expert_ffn: ExpertFfn = "swiglu"  # what each expert is
    moe_norm_topk_prob: bool = True  # renormalise the k chosen probabilities to sum to 1 (Mixtral: yes)
    moe_shared_expert_size: int = 0  # width of an always-on shared expert; 0 = none
    moe_shared_expert_gate: bool = False  # scale the shared expert by sigmoid(w . x) (Qwen2-MoE)
    moe_aux_loss_coef: float = 0.01  # load-balancing loss weight, added to the loss in training mode
    activation_checkpointing: bool = False  # training: keep block inputs only, recompute the rest in backward

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layer", "max_seq_len", "ffn_multiple_of"):
            positive_int(name, getattr(self, name))
        choice("pos_emb", self.pos_emb, POS_EMBS)
        choice("norm", self.norm, NORMS)
        choice("norm_position", self.norm_position, NORM_POSITIONS)
        choice("ffn", self.ffn, FFNS)
        choice("attn_backend", self.attn_backend, ATTN_BACKENDS)
        for name in ("attn_pdrop", "resid_pdrop", "embd_pdrop"):
            probability(name, getattr(self, name), one=False)
        for name in ("bias", "tie_weights", "qk_norm", "moe_norm_topk_prob", "moe_shared_expert_gate",
                     "activation_checkpointing"):
            boolean(name, getattr(self, name))
        self._check_family_and_moe_switches()
        if self.head_dim is not None:
            positive_int("head_dim", self.head_dim)
        elif self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                f"(each head gets d_model / n_heads dimensions)"
            )
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        positive_int("n_kv_heads", self.n_kv_heads)
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                f"(each key/value head serves a whole group of query heads)"
            )
        if self.d_ff is None:
            gated = self.ffn == "swiglu" or (self.ffn == "moe" and self.moe_expert_ffn == "swiglu")
            self.d_ff = llama_ffn_size(self.d_model, self.ffn_multiple_of) if gated else 4 * self.d_model
        positive_int("d_ff", self.d_ff)
        if self.pos_emb == "rope" and self.d_head % 2 != 0:
            raise ValueError(f"pos_emb='rope' needs an even d_head, got d_head={self.d_head}")
        if self.pos_emb == "sinusoidal" and self.d_model % 2 != 0:
            raise ValueError(f"pos_emb='sinusoidal' needs an even d_model, got d_model={self.d_model}")
        if self.init_std is None:
            self.init_std = small_init_std(self.d_model)
        for name in ("rope_theta", "norm_eps", "init_std"):
            positive_number(name, getattr(self, name))

    def _check_family_and_moe_switches(self) -> None:
        if self.qkv_bias is not None:
            boolean("qkv_bias", self.qkv_bias)
        for name in ("n_experts", "n_experts_per_tok"):
            positive_int(name, getattr(self, name))
        if self.n_experts_per_tok > self.n_experts:
            raise ValueError(f"n_experts_per_tok={self.n_experts_per_tok} exceeds n_experts={self.n_experts}; "
                             f"expected top-k <= the number of experts")
        choice("moe_expert_ffn", self.moe_expert_ffn, EXPERT_FFNS)
        integer("moe_shared_expert_size", self.moe_shared_expert_size, low=0,
                expected="an integer >= 0 (0 = no shared expert)")
        number("moe_aux_loss_coef", self.moe_aux_loss_coef, low=0.0)

    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> TransformerConfig:
        choice("preset", name, PRESETS)
        return cls.from_dict({**PRESETS[name], **overrides})

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, dict] = {
    # The debug model: small enough to trace by eye.
    "tiny": dict(vocab_size=100, d_model=64, n_heads=4, d_ff=256, n_layer=2, max_seq_len=32),
    # GPT-2 small (124M): learned positions, LayerNorm, GELU (tanh form), biases, tied head.
    "gpt2-small": dict(
        vocab_size=50257, d_model=768, n_heads=12, d_ff=3072, n_layer=12, max_seq_len=1024,
        ffn="gelu_tanh", bias=True, tie_weights=True, init_std=0.02,
    ),
    # A Llama-shaped model small enough to trace: RoPE, RMSNorm, SwiGLU, GQA, no bias, untied head.
    "llama-tiny": dict(
        vocab_size=100, d_model=64, n_heads=4, n_kv_heads=2, n_layer=2, max_seq_len=64,
        pos_emb="rope", norm="rmsnorm", norm_eps=1e-6, ffn="swiglu", ffn_multiple_of=32,
        bias=False, tie_weights=False,
    ),
    # A Llama-style model a learner can train on a CPU (about 10M parameters with a char vocabulary).
    "llama-style": dict(
        vocab_size=256, d_model=384, n_heads=6, n_kv_heads=2, n_layer=6, max_seq_len=256,
        pos_emb="rope", norm="rmsnorm", norm_eps=1e-6, ffn="swiglu", ffn_multiple_of=64,
        bias=False, tie_weights=False, attn_backend="sdpa",
    ),
    # llama-tiny with a Mixture-of-Experts FFN (Mixtral's layout): 4 experts, each token uses 2.
    "moe-tiny": dict(
        vocab_size=100, d_model=64, n_heads=4, n_kv_heads=2, n_layer=2, max_seq_len=64,
        pos_emb="rope", norm="rmsnorm", norm_eps=1e-6, ffn="moe", d_ff=128, n_experts=4, n_experts_per_tok=2,
        bias=False, tie_weights=False,
    ),
    # `train`'s default: nanoGPT's CPU "baby" Shakespeare model (4 x 128, minutes on a laptop CPU) with the
    # 256-token context of its GPU config, so a served prompt plus its reply fits (64 left a few words), and
    # rotary positions: at 3 sequences of 256 per step, 256 learned position vectors trained far worse
    # (val loss 2.05 against 1.72 for the baby run; README "Set up" has the measurements).
    "shakespeare-char": dict(
        vocab_size=65, d_model=128, n_heads=4, n_layer=4, max_seq_len=256, pos_emb="rope", ffn="gelu",
        bias=True, tie_weights=True, attn_backend="sdpa",
    ),
}
