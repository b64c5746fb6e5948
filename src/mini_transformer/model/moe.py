"""Mixture of Experts: a router sends each token to k of n_experts FFNs and mixes their outputs.

    probs = softmax(router(x))            (N, E)   one distribution over the experts per token
    w, e  = top-k(probs)                  (N, k)   the k chosen experts and their probabilities
    w     = w / sum(w)                    (Mixtral; Qwen3-MoE's `norm_topk_prob` switch)
    y     = sum_j w_j * expert_{e_j}(x)   (+ an optional shared expert every token uses)

Dispatch is dropless and has no Python loop over tokens: the N*k (token, expert) slots are sorted by
expert, each expert runs ONCE on its contiguous block of rows (a grouped matmul), and the outputs are
scattered back to their tokens, weighted. No token is ever dropped for lack of "capacity".
A small batch (decode: N*k <= n_experts) whose sorted path would read the group sizes back to the host
(the loop over experts: CUDA, float64) takes `dispatch_gathered` instead: each slot gathers its expert's
weights and one batched matmul runs every slot, with no sort and nothing read back to the host.

The router logits of the last forward pass stay on the layer (`MoE.router_logits`, (N, E)), so that the
load-balancing loss, `trace` and the benchmark can read them; a forward hook on `MoE.router` sees them too.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import TransformerConfig
from .fused_ops import silu_mul
from .layers import MLP, SwiGLU

ACTIVATIONS = {"gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU}


def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """PyTorch's grouped matmul takes fp32/bf16 on the CPU with rows aligned to 16 bytes; on CUDA bf16 on
    Hopper or newer (sm_90+). Elsewhere on CUDA the padded batched matmul runs (no host read either)."""
    if not hasattr(F, "grouped_mm") or x.dtype != weight.dtype:
        return False
    size = x.element_size()
    aligned = (weight.shape[1] * size) % 16 == 0 and (weight.shape[2] * size) % 16 == 0
    if x.device.type == "cuda":
        return aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return aligned and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor | list[int],
                   expert_of_row: torch.Tensor | None = None) -> torch.Tensor:
    """x (R, in) with its rows sorted by expert, counts (E,) rows per expert, weight (E, out, in)
    -> (R, out): row r of expert e becomes weight[e] @ x[r]. Each expert's weight is read once.
    counts may also be the sizes already read back to the host (a list): then the loop runs. On CUDA
    without the grouped kernel, the padded batched matmul (it needs expert_of_row)."""
    if not isinstance(counts, list) and _grouped_mm_fits(x, weight):
        offsets = counts.cumsum(0).to(torch.int32)  # (E,) end row of each group, stays on the device
        return F.grouped_mm(x.contiguous(), weight.transpose(1, 2), offs=offsets)
    if not isinstance(counts, list) and x.device.type == "cuda":
        return padded_grouped_matmul(x, weight, counts, expert_of_row)
    return grouped_matmul_loop(x, weight, counts)


def padded_grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                          expert_of_row: torch.Tensor) -> torch.Tensor:
    """The same with no host read and no grouped kernel: each expert's rows go into its own (R, in) slab
    of a zero (E, R, in) buffer, one batched matmul runs all E slabs, and each row is read back from its
    place. It computes E times the rows (padding) — the price of never asking the host for the sizes."""
    R = x.shape[0]
    first_row = counts.cumsum(0) - counts  # (E,) where each expert's group starts in the sorted rows
    place = torch.arange(R, device=x.device) - first_row[expert_of_row]  # (R,) row within its group
    slabs = x.new_zeros(weight.shape[0], R, x.shape[1])
    slabs[expert_of_row, place] = x  # (E, R, in)
    out = torch.bmm(slabs, weight.transpose(1, 2))  # (E, R, out)
    return out[expert_of_row, place]  # (R, out)


def grouped_matmul_loop(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
    """The same with a loop over the EXPERTS (not the tokens): one matmul per expert. Splitting needs
    the group sizes on the host (a grouped kernel avoids that read); Experts.forward reads them once
    per layer and hands the list to each of its matrices."""
    sizes = counts if isinstance(counts, list) else counts.tolist()
    return torch.cat([part @ w.T for part, w in zip(x.split(sizes), weight, strict=True)])


class ExpertLinear(nn.Module):
    """n_experts linear maps in nn.Linear's layout: weight (E, out, in), optional bias (E, out)."""

    def __init__(self, n_experts: int, d_in: int, d_out: int, bias: bool, std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_out, d_in).normal_(0.0, std))
        self.bias = nn.Parameter(torch.zeros(n_experts, d_out)) if bias else None

    def forward(self, x, counts, expert_of_row):  # (R, in) sorted by expert -> (R, out)
        out = grouped_matmul(x, self.weight, counts, expert_of_row)
        return out if self.bias is None else out + self.bias[expert_of_row]

    def gathered(self, x: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """x (R, in) in any order, row r through expert expert_of_row[r] -> (R, out), by copying each row's
        expert weight: (R, out, in). Shapes only, so nothing is read back to the host."""
        out = torch.bmm(self.weight[expert_of_row], x.unsqueeze(-1)).squeeze(-1)  # (R, out, in) @ (R, in, 1)
        return out if self.bias is None else out + self.bias[expert_of_row]

    def one(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` alone on x (..., in): the per-token reference uses it."""
        out = x @ self.weight[expert].T
        return out if self.bias is None else out + self.bias[expert]


class Experts(nn.Module):
    """n_experts FFNs of one kind (SwiGLU, or the classic two-matrix MLP), stored as 3-D weights."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        E, C, d_ff, std = cfg.n_experts, cfg.d_model, cfg.d_ff, cfg.init_std
        self.n_experts, self.gated = E, cfg.moe_expert_ffn == "swiglu"
        if self.gated:  # the same names as SwiGLU: w_down is scaled like every residual projection
            self.w_gate = ExpertLinear(E, C, d_ff, cfg.bias, std)
            self.w_up = ExpertLinear(E, C, d_ff, cfg.bias, std)
            self.w_down = ExpertLinear(E, d_ff, C, cfg.bias, std)
        else:
            self.fc1 = ExpertLinear(E, C, d_ff, cfg.bias, std)
            self.fc2 = ExpertLinear(E, d_ff, C, cfg.bias, std)
            self.activation = ACTIVATIONS[cfg.moe_expert_ffn]()

    def forward(self, x, counts, expert_of_row):  # (R, C) sorted by expert -> (R, C)
        if not self.takes_grouped_kernel(x):  # the loop splits by host sizes: one read for all matrices
            counts = counts.tolist()
        return self._ffn(lambda linear, h: linear(h, counts, expert_of_row), x)

    def takes_grouped_kernel(self, x: torch.Tensor) -> bool:
        """Whether grouped_matmul runs without a host read: the grouped kernel, or on CUDA the padded
        batched matmul, rather than the loop.
        Every matrix here spans the same two sizes (C and d_ff) in x's dtype, so the first decides."""
        first = self.w_gate if self.gated else self.fc1
        return x.device.type == "cuda" or _grouped_mm_fits(x, first.weight)

    def gathered(self, x, expert_of_row):  # (R, C) in any order -> (R, C)
        return self._ffn(lambda linear, h: linear.gathered(h, expert_of_row), x)

    def one(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self._ffn(lambda linear, h: linear.one(expert, h), x)

    def _ffn(self, apply, x):
        """The expert FFN with `apply(linear, h)` standing for each of its ExpertLinears."""
        if self.gated:
            hidden = silu_mul(apply(self.w_gate, x), apply(self.w_up, x))  # (R, d_ff)
            return apply(self.w_down, hidden)  # (R, d_ff) -> (R, C)
        return apply(self.fc2, self.activation(apply(self.fc1, x)))


def route(router_logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, E) logits -> the k best experts of each token (N, k) and their weights (N, k), in float32.

    The softmax runs over ALL experts first (so a weight says how sure the router is among everyone);
    with `renormalize` the k chosen weights are then rescaled to sum to 1.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # (N, E)
    weights, experts = probs.topk(k, dim=-1)  # (N, k), (N, k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def dispatch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, ffns: Experts) -> torch.Tensor:
    """x (N, C), weights and experts (N, k) -> sum_j weights[:, j] * ffns[experts[:, j]](x)  (N, C).

    Sort the N*k slots by expert, gather their tokens, run the experts group by group, weight each
    row, and add the rows back onto their tokens. Every slot is computed: nothing is dropped.
    """
    N, k = experts.shape
    flat = experts.reshape(-1)  # (N*k,) the expert of each (token, choice) slot
    order = torch.argsort(flat, stable=True)  # (N*k,) slots grouped by expert
    token_of_row = order // k  # (N*k,) the token each sorted row came from
    counts = torch.zeros(ffns.n_experts, dtype=torch.long, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # (E,) rows per expert, computed without leaving the device
    rows = ffns(x[token_of_row], counts, flat[order])  # (N*k, C)
    rows = rows * weights.reshape(-1)[order].unsqueeze(-1).to(rows.dtype)
    return torch.zeros_like(x).index_add_(0, token_of_row, rows.to(x.dtype))  # (N, C)


def dispatch_gathered(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, ffns: Experts) -> torch.Tensor:
    """The same sum as `dispatch` for small batches: every (token, choice) slot copies its expert's
    weights and one batched matmul runs all N*k slots. No sort, no group sizes, no device->host read
    (the loop over experts needs one per layer), so a decode step stays asynchronous on a GPU."""
    N, k = experts.shape
    slots = x.unsqueeze(1).expand(N, k, x.shape[-1]).reshape(N * k, -1)  # (N*k, C) token n in rows n*k..
    rows = ffns.gathered(slots, experts.reshape(-1)).view(N, k, -1)  # (N, k, C)
    return (rows * weights.unsqueeze(-1).to(rows.dtype)).sum(dim=1).to(x.dtype)  # (N, C)


def small_enough_to_gather(n_tokens: int, k: int, n_experts: int) -> bool:
    """Whether a batch is small enough for dispatch_gathered: N*k <= n_experts (decode). Its copy then
    holds at most n_experts expert weights, as many as the layer has, and it saves the sort, n_experts
    small matmuls and the host sync; past that the copy grows with N while the sorted path reads each
    expert once. Decided from shapes alone, never from the routing values."""
    return n_tokens * k <= n_experts


class MoE(nn.Module):
    """The `ffn="moe"` layer: router + n_experts FFNs (+ an optional shared expert). (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.top_k, self.renormalize = cfg.n_experts_per_tok, cfg.moe_norm_topk_prob
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg)
        self.shared_expert = None
        if cfg.moe_shared_expert_size > 0:  # a dense FFN every token passes through (DeepSeek, Qwen2-MoE)
            shared_cfg = cfg.replace(ffn=cfg.moe_expert_ffn, d_ff=cfg.moe_shared_expert_size)
            self.shared_expert = SwiGLU(shared_cfg) if shared_cfg.ffn == "swiglu" else MLP(shared_cfg)
        self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False) if cfg.moe_shared_expert_gate else None
        self.router_logits: torch.Tensor | None = None  # (N, E) of the last forward pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, C): tokens are routed one by one, batch and time flattened
        self.router_logits = self.router(x)  # (N, E)
        weights, experts = route(self.router_logits, self.top_k, self.renormalize)  # (N, k), (N, k)
        gathered = self._takes_gathered_path(x)
        out = (dispatch_gathered if gathered else dispatch)(x, weights, experts, self.experts)  # (N, C)
        return (out + self._shared(x)).view(shape) if self.shared_expert is not None else out.view(shape)

    def _takes_gathered_path(self, x: torch.Tensor) -> bool:
        """A small batch (`small_enough_to_gather`) whose sorted path would read the group sizes back to
        the host: the loop over experts (CUDA, float64). Where the grouped kernel runs (CPU fp32/bf16) the
        sorted path reads nothing back and is the faster one (bench_moe.py --decode-reps). Expert
        parallelism swaps in its own experts, which send rows between ranks: they keep the sorted path.
        Shapes, dtypes and devices decide, never a tensor's values."""
        if not isinstance(self.experts, Experts):
            return False
        if not small_enough_to_gather(x.shape[0], self.top_k, self.experts.n_experts):
            return False
        return not self.experts.takes_grouped_kernel(x)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_expert(x)  # (N, C)
        return out if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * out


def moe_per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The plain reference the tests and the benchmark measure dispatch against: a Python loop over
    tokens, each running its k experts one at a time. Slow by design."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, experts = route(moe.router(x), moe.top_k, moe.renormalize)
    rows = []
    for n in range(x.shape[0]):
        row = sum(weights[n, j].to(x.dtype) * moe.experts.one(int(experts[n, j]), x[n]) for j in range(moe.top_k))
        rows.append(row + moe._shared(x[n : n + 1])[0] if moe.shared_expert is not None else row)
    return torch.stack(rows).view(shape)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def tokens_per_expert(router_logits: torch.Tensor, k: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """How many (token, choice) slots each expert received: (E,) float, padding (keep False) left out."""
    n_experts = router_logits.shape[-1]
    chosen = router_logits.topk(k, dim=-1).indices.reshape(-1)  # (N*k,) top-k of logits = top-k of probs
    weight = torch.ones(router_logits.shape[0], device=router_logits.device) if keep is None \
        else keep.reshape(-1).float()  # (N,)
    return torch.zeros(n_experts, device=router_logits.device).scatter_add_(0, chosen, weight.repeat_interleave(k))


def load_balancing_loss(router_logits: list[torch.Tensor], k: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, the mean over layers of  E * sum_e f_e * P_e :
    f_e = the share of the N*k assignments that went to expert e (counted, no gradient),
    P_e = the mean router probability of expert e (differentiable).
    Both are uniform (1/E) when the load is balanced, and the loss is then exactly 1; it grows when
    the router sends many tokens where it is also confident. `keep` (B, T) leaves padding out.
    (Hugging Face's Mixtral pools all layers into one f and one P and does not divide by k.)"""
    losses = []
    for logits in router_logits:
        n_experts = logits.shape[-1]
        probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
        weight = torch.ones(probs.shape[0], device=probs.device) if keep is None else keep.reshape(-1).float()
        n_real = weight.sum().clamp(min=1)
        share = tokens_per_expert(logits, k, keep) / (n_real * k)  # (E,) f_e, sums to 1
        mean_prob = (probs * weight[:, None]).sum(dim=0) / n_real  # (E,) P_e, sums to 1
        losses.append(n_experts * (share * mean_prob).sum())
    return torch.stack(losses).mean()


def moe_aux_loss(model: nn.Module, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The load-balancing loss of a model's last forward pass, padding (attention_mask 0) left out."""
    keep = None if attention_mask is None else attention_mask.bool()  # (B, T)
    layers = moe_layers(model)
    return load_balancing_loss([moe.router_logits for moe in layers], layers[0].top_k, keep)
