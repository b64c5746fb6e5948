"""Speculative decoding: a cheap guesser drafts k tokens, the target checks them all in ONE forward pass.

A decode step of the target reads all its weights to produce one token; verifying k + 1 positions in one
pass reads them once too. When the drafts are often right, several tokens come out per target pass.

The acceptance rule (Leviathan et al. 2023; Chen et al. 2023) keeps the TARGET's distribution exactly.
With p the target's and q the drafter's next-token probabilities at a drafted position, and d ~ q:

    accept d with probability min(1, p(d) / q(d));
    on the first rejection, draw from  r = max(p - q, 0) / sum(max(p - q, 0))  and stop the round;
    if all k drafts are accepted, draw one bonus token from the target's distribution after them.

Why it is exact: P(d accepted and = x) = q(x) min(1, p(x)/q(x)) = min(q(x), p(x)), and
P(rejected) * r(x) = (1 - sum_y min(p(y), q(y))) * r(x) = max(p(x) - q(x), 0); the two add up to p(x).
Greedy decoding is the special case p, q one-hot: a draft survives iff it is the target's argmax.

Drafters: a small TransformerLM (`draft_model`), or prompt lookup (`draft_model="prompt_lookup"`): copy
the tokens that followed the latest earlier occurrence of the context's last n-gram (q is one-hot, no
model at all; it shines when the output repeats its input: code edits, quoting, summaries).

Both models keep a `KVCache`; after a rejection the caches `rollback()` the slots of the rejected drafts.
One row (B = 1): rows accepting different counts would need ragged caches. Tokens are chosen with
sampling.py's own filter chain (`filtered_logits`) and exponential race (`draw_from_probs`), and each
round reads the device twice, never once per token: the k drafts, then the accepted count with the
token that follows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._checks import positive_int
from ..model.transformer import TransformerLM
from .kv_cache import KVCache
from .sampling import SamplingParams, draw_from_probs, filtered_logits

PROMPT_LOOKUP = "prompt_lookup"


@dataclass
class SpeculativeStats:
    """Counts of one speculative run: acceptance rate = accepted / drafted."""

    rounds: int = 0  # target forward passes after the prefill
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(R, V) logits -> (R, V) probabilities of the token sample_next would draw (one-hot when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    return torch.softmax(filtered_logits(logits, params), dim=-1)


def accept_drafts(p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator) -> tuple[int, int]:
    """The acceptance rule. p (k+1, V) target probabilities at each drafted position and after the last;
    q (k, V) the drafter's; drafts the k drafted ids. Returns (n accepted, the token that follows them).

    All on the device, one read back per round: the k uniforms are drawn at once, and a follow-up token is
    drawn for every possible n (the residual after a rejection at row i, or the bonus from p[k]); the
    first rejection picks n and with it the token."""
    k = len(drafts)
    rows = torch.arange(k, device=p.device)
    ids = torch.tensor(drafts, dtype=torch.long, device=p.device)
    ratio = p[rows, ids] / q[rows, ids]  # (k,); q[i, d] > 0: d was drawn from q[i]
    accepted = torch.rand(k, generator=generator, device=p.device) < ratio  # (k,)
    n_accepted = accepted.long().cumprod(dim=0).sum()  # the run of acceptances before the first rejection
    residual = (p[:k] - q).clamp(min=0)  # (k, V); the race normalises, so no division
    # p == q: a rejection has probability 0, but rounding may still make one; draw from p then
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p[:k])
    follow_ups = draw_from_probs(torch.cat([residual, p[k:]]), generator)  # (k + 1,)
    n, token = torch.stack([n_accepted, follow_ups[n_accepted]]).tolist()  # the round's one host read
    return n, token


def lookup_drafts(tokens: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max_ngram .. 1) and
    return up to k tokens that followed it; [] when nothing matches."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


class _ModelDrafter:
    """A draft model with its own cache. `pending` holds the committed tokens its cache lacks (1 or 2)."""

    def __init__(self, model: TransformerLM, prompt: torch.Tensor, max_len: int):
        self.model = model
        self.cache = KVCache.for_model(model, 1, max_len, dtype=model.tok_emb.weight.dtype,
                                       device=prompt.device)
        if prompt.shape[1] > 1:
            model.logits(prompt[:, :-1], cache=self.cache)
        self.pending = [int(prompt[0, -1])]

    def propose(self, k: int, params: SamplingParams, generator) -> tuple[list[int], torch.Tensor]:
        """Draft k tokens; returns them and q (k, V). The cache then lacks only the last draft.
        Each draft is fed back as a device tensor: the k ids are read back once, at the end."""
        logits = self._next_logits(torch.tensor([self.pending], device=self.cache.k.device))
        drafts, q_rows = [], []
        for i in range(k):
            q = token_probs(logits, params)  # (1, V)
            drafts.append(draw_from_probs(q, generator))  # (1,)
            q_rows.append(q)
            if i < k - 1:
                logits = self._next_logits(drafts[-1][:, None])
        return torch.cat(drafts).tolist(), torch.cat(q_rows)  # (k,) ids, (k, V)

    def _next_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (1, n) -> the logits after its last token (1, V)."""
        return self.model.logits(idx, cache=self.cache)[:, -1]

    def commit(self, drafts: list[int], n_accepted: int, next_token: int) -> None:
        if n_accepted == len(drafts):  # the last draft was never fed to the draft model
            self.pending = [drafts[-1], next_token]
        else:
            self.cache.rollback(len(drafts) - 1 - n_accepted)
            self.pending = [next_token]


def _check_speculative_args(target, idx, params, draft_model, k) -> None:
    if idx.shape[0] != 1:
        raise ValueError(f"speculative decoding runs one row; idx has batch size {idx.shape[0]}")
    positive_int("num_speculative_tokens", k)
    if params.penalised or params.logit_bias or params.min_tokens:
        raise ValueError("speculative decoding does not take repetition_penalty, presence/frequency_penalty, "
                         "logit_bias or min_tokens (they change p at every draft)")
    if params.structured is not None:
        raise ValueError("speculative decoding with structured output is refused: the drafts are not checked "
                         "against the grammar's token mask (run constrained requests through LLMEngine)")
    if isinstance(draft_model, str):
        if draft_model != PROMPT_LOOKUP:
            raise ValueError(f"draft_model={draft_model!r}: expected a TransformerLM or {PROMPT_LOOKUP!r}")
        return
    if not isinstance(draft_model, TransformerLM):
        raise TypeError(f"draft_model must be a TransformerLM or {PROMPT_LOOKUP!r}, got {type(draft_model).__name__}")
    draft_model.check_backend(training=False)
    if draft_model.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft vocab_size={draft_model.config.vocab_size} differs from the target's "
                         f"{target.config.vocab_size}; they must share a tokenizer")
    needed = idx.shape[1] + params.max_tokens
    if needed > draft_model.config.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens = {needed} exceeds the draft's max_seq_len="
                         f"{draft_model.config.max_seq_len}")


def _draft(drafter: _ModelDrafter | None, tokens: list[int], k: int, params: SamplingParams, generator,
           vocab_size: int, device) -> tuple[list[int], torch.Tensor]:
    """k drafted ids (fewer when prompt lookup finds fewer) and the drafter's q (k, V)."""
    if drafter is not None and k > 0:
        return drafter.propose(k, params, generator)
    drafts = lookup_drafts(tokens, k) if k > 0 else []
    ids = torch.tensor(drafts, dtype=torch.long, device=device)
    return drafts, torch.nn.functional.one_hot(ids, vocab_size).float()  # (k, V): a sure guess


@torch.inference_mode()
def speculative_generate(
    target: TransformerLM,
    idx: torch.Tensor,
    params: SamplingParams,
    draft_model: TransformerLM | str,
    num_speculative_tokens: int = 4,
    *,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    stream: Callable[[torch.Tensor], None] | None = None,
    stats: SpeculativeStats | None = None,
) -> torch.Tensor:
    """generate()'s speculative path (it has checked idx and params): the new ids (1, params.max_tokens).
    A stop token ends the output; the slots after it repeat it, as in generate()."""
    _check_speculative_args(target, idx, params, draft_model, num_speculative_tokens)
    generator = params.make_generator(idx.device) if generator is None else generator
    stats = SpeculativeStats() if stats is None else stats
    device, n_new = idx.device, params.max_tokens
    stops = set(params.stops(eos_token_id))
    models = [target] + ([draft_model] if isinstance(draft_model, TransformerLM) else [])
    was_training = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        max_len = idx.shape[1] + n_new
        cache = KVCache.for_model(target, 1, max_len, dtype=target.tok_emb.weight.dtype, device=device)
        if idx.shape[1] > 1:  # the target's cache holds every committed token but the last
            target.logits(idx[:, :-1], cache=cache)
        drafter = _ModelDrafter(draft_model, idx, max_len) if len(models) == 2 else None
        tokens = idx[0].tolist()
        new: list[int] = []
        while len(new) < n_new and not (stops and new and new[-1] in stops):
            k = min(num_speculative_tokens, n_new - len(new) - 1)  # never run past max_tokens
            drafts, q = _draft(drafter, tokens, k, params, generator, target.config.vocab_size, device)
            verify = torch.tensor([[tokens[-1], *drafts]], device=device)  # (1, k + 1)
            p = token_probs(target.logits(verify, cache=cache)[0], params)  # (k + 1, V)
            n_accepted, next_token = accept_drafts(p, q, drafts, generator)
            cache.rollback(len(drafts) - n_accepted)
            if drafter is not None and drafts:
                drafter.commit(drafts, n_accepted, next_token)
            elif drafter is not None:
                drafter.pending.append(next_token)
            stats.rounds += 1
            stats.drafted += len(drafts)
            stats.accepted += n_accepted
            for token in [*drafts[:n_accepted], next_token]:
                tokens.append(token)
                new.append(token)
                if stream is not None:
                    stream(torch.tensor([token], device=device))
                if token in stops:
                    break
    finally:
        for m, mode in zip(models, was_training, strict=True):
            m.train(mode)
    new += [new[-1]] * (n_new - len(new))  # a stopped row repeats its stop token
    return torch.tensor([new], dtype=torch.long, device=device)
