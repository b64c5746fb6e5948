"""`mini-transformer trace`: run one forward pass and draw the data flow with the real tensor shapes.

The shapes are taken with forward hooks on the model's modules: the model itself prints nothing.
"""

from __future__ import annotations

import torch

from .._checks import integer, positive_int
from ..attention.mask import build_mask
from ..attention.naive import attention_scores, attention_weights
from ..config import TransformerConfig
from ..model.moe import MoE, route, tokens_per_expert
from ..model.transformer import Attend, TransformerLM


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


class ShapeRecorder:
    """Registers forward hooks that append (indent, label, shape, note) rows in execution order."""

    def __init__(self, model: TransformerLM):
        self.rows: list[tuple[int, str, str, str]] = []
        self.handles = []
        cfg = model.config
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        self._hook(model.tok_emb, 1, "tok_emb: token embedding", "(B, T, C)")
        if model.pos_emb is not None:
            self._hook(model.pos_emb, 1, "pos_emb: learned position embedding", "(B, T, C), added")
        self._hook(model.emb_drop, 0, f"x = embeddings ({cfg.pos_emb} positions)", "(B, T, C)")
        for i, block in enumerate(model.blocks):
            self.handles.append(block.register_forward_pre_hook(
                lambda m, a, i=i: self.rows.append((0, f"block {i} ({cfg.norm_position}-norm)", "", ""))))
            self._hook(block.norm_1, 1, f"norm_1 ({cfg.norm})", "")
            width = f"(B, T, (H + 2*Hkv) * D) = (B, T, {(H + 2 * Hkv) * D})"
            self._hook(block.attn.W_qkv, 1, "W_qkv: fused q/k/v projection", width)
            self._hook_attend(block.attn.attend, cfg)
            self._hook(block.attn.W_o, 1, "W_o: heads joined, projected", "(B, T, C): attention out")
            self._hook(block.norm_2, 1, f"norm_2 ({cfg.norm})", "")
            if isinstance(block.ffn, MoE):
                self._hook_moe(block.ffn, cfg)
            else:
                first = getattr(block.ffn, "fc1", None) or getattr(block.ffn, "w_up", None)
                self._hook(first, 1, f"ffn up-projection ({cfg.ffn})", "(B, T, d_ff)")
                self._hook(block.ffn, 1, "ffn out", "(B, T, C)")
            self._hook(block, 1, "block out (residual stream)", "(B, T, C)")
        self._hook(model.norm_f, 0, f"final norm ({cfg.norm})", "(B, T, C)")
        self._hook(model.lm_head, 0, "lm_head -> logits", "(B, T, V)")

    def _hook(self, module, indent: int, label: str, note: str) -> None:
        def record(_module, _inputs, output):
            self.rows.append((indent, label, _shape(output), note))

        self.handles.append(module.register_forward_hook(record))

    def _hook_attend(self, attend: Attend, cfg: TransformerConfig) -> None:
        def record(_module, inputs, output):
            q, k, v, keep = inputs
            Tq, Tk = q.shape[2], k.shape[2]
            scores = attention_scores(q, k, cfg.d_head**-0.5)  # (B, Hkv, G, Tq, Tk)
            mask = build_mask(Tq, Tk, causal=True, key_padding_mask=keep, device=q.device)
            weights = attention_weights(scores, mask)
            B, H, Hkv = q.shape[0], q.shape[1], k.shape[1]
            rope = ", RoPE applied" if cfg.pos_emb == "rope" else ""
            # the tensor is (B, H + 2*Hkv, T, D); with Hkv == H its split equals the (B, T, 3, H, D) permute
            layout = "(B, 3H, T, D), split = (3, B, H, T, D)" if Hkv == H else "(B, H + 2*Hkv, T, D), split H/Hkv/Hkv"
            self.rows += [
                (1, "view + transpose", f"({B}, {H + 2 * Hkv}, {Tq}, {cfg.d_head})", layout),
                (1, "q (split heads" + rope + ")", _shape(q), "(B, H, T, D)"),
                (1, "k" + rope.replace(", ", " (") + (")" if rope else ""), _shape(k), "(B, Hkv, T, D)"),
                (1, "v (never rotated)" if rope else "v", _shape(v), "(B, Hkv, T, D)"),
                (1, "scores = q k^T / sqrt(D)", _shape(scores.reshape(B, H, Tq, Tk)), "(B, H, T, T): grows as T^2"),
                (1, "weights = softmax(masked scores)", _shape(weights.reshape(B, H, Tq, Tk)), "rows sum to 1"),
                (1, "weights @ v", _shape(output), "(B, H, T, D)"),
            ]

        self.handles.append(attend.register_forward_hook(record))

    def _hook_moe(self, moe: MoE, cfg: TransformerConfig) -> None:
        """The router, the top-k choice and how many tokens each expert got, read after the layer ran."""

        def record(_module, _inputs, output):
            logits = moe.router_logits  # (N, E)
            N, E, k = logits.shape[0], logits.shape[1], cfg.n_experts_per_tok
            weights, experts = route(logits, k, cfg.moe_norm_topk_prob)  # (N, k), (N, k)
            counts = [int(c) for c in tokens_per_expert(logits, k).tolist()]
            first = ", ".join(f"e{e}: {w:.2f}" for e, w in zip(experts[0].tolist(), weights[0].tolist(), strict=True))
            shared = [(1, "shared expert (every token)", f"({N}, {cfg.d_model})", "added to the routed sum")] \
                if cfg.moe_shared_expert_size else []
            self.rows += [
                (1, "ffn = MoE: tokens flattened", f"({N}, {cfg.d_model})", "(N, C), N = B*T tokens routed one by one"),
                (1, "router logits = W_router x", _shape(logits), f"(N, E): a score for each of the {E} experts"),
                (1, f"softmax, top-{k} experts", _shape(experts), f"(N, k); token 0 -> {first}"),
                (1, "tokens per expert", f"[{', '.join(map(str, counts))}]",
                 f"sum = N*k = {N * k}; fair share {N * k / E:g}"),
                (1, "rows sorted by expert, grouped matmul", f"({N * k}, {cfg.d_ff})", "(N*k, d_ff): each expert once"),
                *shared,
                (1, "weighted rows added back to tokens", _shape(output), "(B, T, C): ffn out"),
            ]

        self.handles.append(moe.register_forward_hook(record))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def trace(cfg: TransformerConfig, batch_size: int = 2, seq_len: int = 8, seed: int = 0) -> str:
    """Run one forward pass on random ids and return the data-flow diagram with every shape."""
    positive_int("batch_size", batch_size)
    integer("seq_len", seq_len, low=1, high=cfg.max_seq_len,
            expected=f"an integer in [1, max_seq_len={cfg.max_seq_len}] (the config's context)")
    torch.manual_seed(seed)
    model = TransformerLM(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    recorder = ShapeRecorder(model)
    with torch.no_grad():
        logits, _ = model(idx)
    recorder.remove()
    lines = [
        f"B={batch_size} T={seq_len} C=d_model={cfg.d_model} H={cfg.n_heads} Hkv={cfg.n_kv_heads} "
        f"D=d_head={cfg.d_head} d_ff={cfg.d_ff} V={cfg.vocab_size} layers={cfg.n_layer}",
        "",
        f"{'token ids':<46}{_shape(idx):<18}(B, T) int64",
    ]
    for indent, label, shape, note in recorder.rows:
        if not shape:
            lines.append("│\n▼ " + label)
            continue
        prefix = "  ├─ " if indent else ""
        lines.append(f"{prefix + label:<46}{shape:<18}{note}".rstrip())
    lines.append(f"\nlogits {_shape(logits)}: one score per vocabulary entry at every position")
    return "\n".join(lines)
