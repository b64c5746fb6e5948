"""The model: MultiHeadAttention (fused QKV, GQA), TransformerBlock (pre/post norm), TransformerLM."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .._checks import instance
from ..attention import check_backend, get_backend
from ..checkpoint import read_checkpoint, write_checkpoint
from ..config import TransformerConfig
from . import fused_ops
from .cache import Cache, CheckedCache, NoCache
from .layers import MLP, RMSNorm, SwiGLU
from .moe import MoE, moe_aux_loss
from .quantize import quantize
from .rope import RotaryEmbedding, sinusoidal_table


def dropout(p: float) -> nn.Module:
    """nn.Dropout, or a plain pass-through when p == 0 (saves a call per use when decoding)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


def check_token_ids(idx, vocab_size: int) -> tuple[int, int]:
    """idx must be a non-empty 2-D int64/int32 tensor (B, T) of ids in [0, vocab_size); returns (B, T).

    A door check: it reads the ids' range back from the device, so it runs once per call a user makes,
    never inside a decode loop."""
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32) or idx.dim() != 2:
        shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
        dtype = getattr(idx, "dtype", None)
        raise ValueError(f"idx must be a 2-D int64 or int32 tensor (B, T), got {shape} of dtype {dtype}")
    B, T = idx.shape
    if B == 0 or T == 0:
        raise ValueError(f"idx has shape {(B, T)} (B={B}, T={T}); expected at least one row and one token")
    low, high = int(idx.min()), int(idx.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"idx contains token id {bad}, outside [0, vocab_size={vocab_size})")
    return B, T


def check_attention_mask(attention_mask, shape: tuple[int, int]) -> None:
    """attention_mask must be a (B, T) tensor of 0 (padding) and 1 (real token), like idx."""
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask has shape {got}, expected (B, T) = {shape} like idx")
    if attention_mask.is_floating_point() or bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token), as bool or integers")


class Attend(nn.Module):
    """softmax(q k^T / sqrt(D)) v through the configured backend, causal, queries at the end of the keys.

    No parameters: it exists so that hooks (and `mini-transformer trace`) can see q, k, v and the output
    of every layer. The backend function is looked up once here; it trusts its inputs. The layer hands it
    to `cache.attend`: the contiguous caches call it, the engine's paged attention calls it for prefill
    chunks (model/cache.py)."""

    def __init__(self, backend: str, dropout_p: float):
        super().__init__()
        self.backend = backend
        self.fn = get_backend(backend)
        self.dropout_p = dropout_p

    def forward(self, q, k, v, key_padding_mask=None):
        dropout_p = self.dropout_p if self.training else 0.0
        return self.fn(q, k, v, causal=True, key_padding_mask=key_padding_mask, dropout_p=dropout_p,
                       scale=1.0 / math.sqrt(q.shape[-1]))


class MultiHeadAttention(nn.Module):
    """Causal self-attention with ONE fused projection for q, k and v.

    With n_kv_heads == n_heads the fused output (B, T, 3C) is exactly the classic
    (B, T, 3, H, D) -> (3, B, H, T, D) layout; with fewer kv heads (GQA/MQA) it is
    (B, T, H + 2*Hkv, D), split into H query heads and Hkv key and value heads.
    """

    def __init__(self, cfg: TransformerConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.d_head = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        qkv_bias = cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias
        self.W_qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head, bias=qkv_bias)
        self.W_o = nn.Linear(cfg.n_heads * cfg.d_head, cfg.d_model, bias=cfg.bias)
        # Qwen3: RMSNorm over each head's D dims of q and k keeps the scores' scale in check
        self.q_norm = RMSNorm(cfg.d_head, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.d_head, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.attend = Attend(cfg.attn_backend, cfg.attn_pdrop)

    def forward(self, x, cache: Cache, rope=None):
        B, T, C = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.d_head
        qkv = self.W_qkv(x)  # (B, T, (H + 2*Hkv) * D)
        qkv = qkv.view(B, T, H + 2 * Hkv, D).transpose(1, 2)  # (B, H + 2*Hkv, T, D)
        q, k, v = qkv.split([H, Hkv, Hkv], dim=1)  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # RoPE turns q and k by their positions; v carries content only
            cos, sin = rope  # (B, 1, T, D)
            q, k = fused_ops.rope(q, cos, sin), fused_ops.rope(k, cos, sin)
        out = cache.attend(self.layer_idx, q, k, v, self.attend)  # (B, H, T, D): keys kept, then attended
        out = out.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D): heads concatenated again
        return self.W_o(out)


def make_norm(cfg: TransformerConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def make_ffn(cfg: TransformerConfig) -> nn.Module:
    """The block's feed-forward: the classic MLP, Llama's SwiGLU, or a Mixture of Experts of either."""
    if cfg.ffn == "moe":
        return MoE(cfg)
    return SwiGLU(cfg) if cfg.ffn == "swiglu" else MLP(cfg)


class TransformerBlock(nn.Module):
    """Attention then FFN, each wrapped in a residual; the norm sits before (pre) or after (post)."""

    def __init__(self, cfg: TransformerConfig, layer_idx: int):
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        self.norm_1 = make_norm(cfg)
        self.attn = MultiHeadAttention(cfg, layer_idx)
        self.norm_2 = make_norm(cfg)
        self.ffn = make_ffn(cfg)
        self.resid_drop = dropout(cfg.resid_pdrop)

    def forward(self, x, cache: Cache, rope=None):
        if self.pre_norm:  # x + f(norm(x)): the residual stream itself is never normalised
            x = x + self.resid_drop(self.attn(self.norm_1(x), cache, rope))
            return x + self.resid_drop(self.ffn(self.norm_2(x)))
        x = self.norm_1(x + self.resid_drop(self.attn(x, cache, rope)))  # norm(x + f(x))
        return self.norm_2(x + self.resid_drop(self.ffn(x)))


def lm_loss(logits, targets):
    """Mean cross-entropy over the targets that are not -100 (0 if there are none). logits (B, T, V)."""
    flat = targets.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), flat, ignore_index=-100, reduction="sum")
    return total / (flat != -100).sum().clamp(min=1)


class TransformerLM(nn.Module):
    """ids (B, T) -> embeddings -> N blocks -> final norm -> logits (B, T, V)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        instance("cfg", cfg, TransformerConfig)
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.pos_emb == "learned" else None
        if cfg.pos_emb == "sinusoidal":
            self.register_buffer("sinusoid", sinusoidal_table(cfg.max_seq_len, cfg.d_model), persistent=False)
        self.rope = RotaryEmbedding(cfg.d_head, cfg.max_seq_len, cfg.rope_theta) if cfg.pos_emb == "rope" else None
        self.emb_drop = dropout(cfg.embd_pdrop)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layer))
        self.norm_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:  # the head reuses the embedding matrix: one tensor, one storage
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 * n_layer)
        for name, param in self.named_parameters():
            if name.endswith(("W_o.weight", "fc2.weight", "w_down.weight")):
                nn.init.normal_(param, mean=0.0, std=cfg.init_std / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() counts a tied tensor once

    def forward(self, idx, targets=None, *, attention_mask=None, cache: Cache | None = None,
                logits_at: torch.Tensor | None = None):
        """idx (B, T) token ids; targets (B, T) next-token ids, -100 = ignored; attention_mask (B, T),
        1 = real token (left padding; with a cache it covers the new tokens only); cache: a `KVCache`
        to read and extend. Returns (logits (B, T, V), loss or None).

        logits_at (K,) int: compute logits only at these positions of T (then (B, K, V)). Generating
        reads one row per sequence, and the head over the whole vocabulary is the costliest layer.

        This is the door: it checks its inputs (`check_inputs`). Callers that checked theirs once
        already (generate, the engine) call `logits` instead, since checking token ids reads them back
        from the device."""
        if not torch.compiler.is_compiling():  # reading values would split a compiled graph
            self.check_inputs(idx, targets, attention_mask, cache, logits_at)
        logits = self.logits(idx, attention_mask=attention_mask, cache=cache, logits_at=logits_at)
        loss = None if targets is None else lm_loss(logits, targets)
        if loss is not None and self.training and self.config.ffn == "moe" and self.config.moe_aux_loss_coef > 0:
            loss = loss + self.config.moe_aux_loss_coef * moe_aux_loss(self, attention_mask)  # training only
        return logits, loss

    def logits(self, idx, *, attention_mask=None, cache: Cache | None = None,
               logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` without its checks and without a loss: the logits (B, T or K, V) of inputs the
        caller has checked already (the same arguments as forward's)."""
        cache = NoCache() if cache is None else cache
        positions = cache.begin(idx, attention_mask)  # (B, T): left padding does not count
        x = self.emb_drop(self.embed(idx, positions))  # (B, T, C)
        x = self.run_blocks(self.blocks, x, cache, positions)  # (B, T, C)
        if logits_at is not None:
            x = x[:, logits_at]  # (B, K, C): only the positions whose next token someone will pick
        return self.lm_head(self.norm_f(x))  # (B, T or K, V)

    def run_blocks(self, blocks, x, cache: Cache, positions):
        """x (B, T, C) through `blocks` (all of self.blocks, or a pipeline stage's run of them, see
        parallel/pp.py), each turning q and k by `positions` (B, T) when the model uses RoPE."""
        rope = self.rope.cos_sin(positions, x.dtype) if self.rope is not None else None  # (B, 1, T, D) x 2
        recompute = self.config.activation_checkpointing and torch.is_grad_enabled()  # keep block inputs only
        for block in blocks:
            x = checkpoint(block, x, cache, rope, use_reentrant=False) if recompute else block(x, cache, rope)
        return x

    def embed(self, idx, positions):
        """Token embeddings plus, for learned or sinusoidal positions, the position's vector: (B, T, C)."""
        x = self.tok_emb(idx)  # (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        elif self.config.pos_emb == "sinusoidal":
            x = x + self.sinusoid[positions]
        return x

    @property
    def kv_heads(self) -> int:
        """The key/value heads each attention layer of this model holds, what a KV cache must store:
        config.n_kv_heads, or under tensor parallelism this rank's share (parallel/tp.py cuts the layers,
        the config stays the whole model's)."""
        return self.blocks[0].attn.n_kv_heads

    def check_backend(self, training: bool | None = None) -> None:
        """Can the configured attention backend run this model as it is now (its dtype, device, head size,
        and attention dropout when run in training mode; `training=None`: the model's mode now)? Asked once
        at each door (forward's, generate's, the engine's, train's), never by the layers: `Attend` calls
        the backend function as it is."""
        weight, cfg = self.tok_emb.weight, self.config
        training = self.training if training is None else training
        check_backend(cfg.attn_backend, weight.dtype, cfg.d_head, weight.device, cfg.attn_pdrop if training else 0.0)

    def check_inputs(self, idx, targets=None, attention_mask=None, cache=None, logits_at=None) -> None:
        """The door of `forward`: raise ValueError/TypeError naming the first bad argument."""
        cfg = self.config
        self.check_backend()
        B, T = check_token_ids(idx, cfg.vocab_size)
        if logits_at is not None:
            if not isinstance(logits_at, torch.Tensor) or logits_at.dim() != 1 or logits_at.is_floating_point():
                raise ValueError(f"logits_at must be a 1-D integer tensor of positions, got {logits_at!r}")
            if targets is not None:
                raise ValueError("logits_at and targets do not go together: the loss needs every position's logits")
            if logits_at.numel() and not -T <= int(logits_at.min()) <= int(logits_at.max()) < T:
                raise ValueError(f"logits_at holds positions outside [-{T}, {T}) (T={T})")
        past = cache.length if isinstance(cache, CheckedCache) else 0
        if past + T > cfg.max_seq_len:
            raise ValueError(
                f"sequence length {past + T} (cached {past} + new {T}) exceeds max_seq_len={cfg.max_seq_len}"
            )
        if cache is not None:
            if not isinstance(cache, CheckedCache):
                raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
            cache.check_fits(self, B, T, self.tok_emb.weight.dtype)
        if attention_mask is not None:
            check_attention_mask(attention_mask, (B, T))
        if targets is not None:
            if not isinstance(targets, torch.Tensor) or tuple(targets.shape) != (B, T):
                shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
                raise ValueError(f"targets has shape {shape}, expected (B, T) = {(B, T)} like idx")
            if targets.is_floating_point():
                raise ValueError(f"targets must be an integer tensor, got dtype {targets.dtype}")
            bad = (targets != -100) & ((targets < 0) | (targets >= cfg.vocab_size))
            if bool(bad.any()):
                raise ValueError(f"targets contain id {int(targets[bad][0])}, expected [0, {cfg.vocab_size}) or -100")

    @classmethod
    def from_pretrained(cls, path, *, device: str | torch.device = "cpu", **overrides) -> TransformerLM:
        """Load our own checkpoint directory (its manifest verified) or a local Hugging Face GPT-2 / Llama
        directory. `overrides` change config fields (e.g. attn_backend="sdpa"). The model comes back in
        eval mode (dropout off), like Hugging Face's from_pretrained; call .train() to fine-tune."""
        def build(config: TransformerConfig, quantization: dict | None) -> TransformerLM:
            model = cls(config)  # a quantized checkpoint gets its quantized linears before the tensors load
            return model if quantization is None else quantize(model, quantization["mode"], quantization["group_size"])

        return read_checkpoint(path, build, **overrides).to(device).eval()

    def save_pretrained(self, path) -> None:
        """Write `config.json`, `model.safetensors` and `manifest.json` (their sha256) to the directory `path`;
        a quantized model (quantize.py) also writes `quantization.json`, so from_pretrained rebuilds it quantized."""
        write_checkpoint(path, self.config, self.state_dict(), quantization=getattr(self, "quantization", None))
