"""Log-probabilities on the device, and the step's one device -> host read.

Two kinds of rows ask for logprobs: a sampled token's (`logprobs=N`: the chosen token and the N most
likely), gathered by the sampler on its batch, and a prompt token's (`prompt_logprobs=N`), whose rows of
the packed forward get the model's head only when some request asks (`PromptLogprobs`). Both are of the
RAW logits: log_softmax before any bias, penalty or temperature (vLLM's default).

Everything the host needs from a step -- the sampled ids, and the logprobs asked for -- comes back in one
copy (`read_back`): the tensors are flattened into one float64 vector (float64 holds token ids exactly),
read with one `.tolist()`, and unpacked onto their sequences. The other direction, a host list onto the
device (`to_device`), lives here too, the lowest of the sampler's modules (batch_plan.py, sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence, TokenLogprob


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor; on CUDA through pinned memory, without waiting for the copy."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class LogprobsTensors:
    """The logprobs of L rows, still on the device: the chosen token's (L,), and the n most likely
    tokens' values and ids (L, n) (None when n is 0)."""

    chosen: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None

    @classmethod
    def of(cls, logits: torch.Tensor, chosen_ids: torch.Tensor, n: int) -> LogprobsTensors:
        """(L, V) raw logits and the (L,) chosen ids -> their logprobs and the top n of each row."""
        logp = torch.log_softmax(logits.float(), dim=-1)  # (L, V)
        chosen = logp.gather(1, chosen_ids[:, None])[:, 0]  # (L,)
        if n == 0:
            return cls(chosen, None, None)
        top = logp.topk(n, dim=-1)  # (L, n) values and ids
        return cls(chosen, top.values, top.indices)

    def parts(self) -> list[torch.Tensor]:
        """The tensors to read back, in the order `unpack` reads them."""
        return [self.chosen] if self.top_values is None else [self.chosen, self.top_values, self.top_ids]

    def unpack(self, flat: list[float], at: int, tokens: list[int], wants: list[int]) -> tuple[list[TokenLogprob], int]:
        """This object's L rows from the read-back list `flat`, starting at `at`: one TokenLogprob per row
        (its token, and the first `wants[i]` of the top n). Returns them and where the next part starts."""
        L = len(tokens)
        n = 0 if self.top_values is None else self.top_values.shape[1]
        chosen, values, ids = flat[at:at + L], flat[at + L:at + L + L * n], flat[at + L + L * n:at + L + 2 * L * n]
        logprobs = []
        for i, (token, want) in enumerate(zip(tokens, wants, strict=True)):
            top = tuple((int(ids[i * n + j]), values[i * n + j]) for j in range(want))
            logprobs.append(TokenLogprob(token, chosen[i], top))
        return logprobs, at + L + 2 * L * n


@dataclass(frozen=True)
class LogprobRows:
    """The rows of a sampler batch whose requests ask logprobs of their sampled tokens; part of the
    sampler's plan, so the index is built once per batch, not per step."""

    rows: list[int]
    index: torch.Tensor  # (L,) the rows, on the device
    n: int  # the most top logprobs any of them asks

    @classmethod
    def of(cls, seqs: list[Sequence], device: torch.device) -> LogprobRows | None:
        rows = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if not rows:
            return None
        return cls(rows=rows, index=to_device(rows, torch.long, device),
                   n=max(seqs[row].params.logprobs for row in rows))


@dataclass
class Sampled:
    """One step's sampling, still on the device: the (M,) ids, and the logprobs of the rows that ask."""

    ids: torch.Tensor
    logprob_rows: LogprobRows | None = None
    logprobs: LogprobsTensors | None = None


@dataclass
class PromptLogprobs:
    """The rows of a step's packed batch whose logits score a prompt token, for the sequences that asked
    prompt_logprobs: row r (position p of its sequence) predicts prompt token p + 1, `targets`, and
    `owners` says (sequence, p + 1). Their logits are computed on these rows only (logits_at)."""

    rows: list[int]
    targets: list[int]
    owners: list[tuple[Sequence, int]]
    tensors: LogprobsTensors | None = None  # once computed

    @classmethod
    def of(cls, scheduled: list[tuple[Sequence, int]]) -> PromptLogprobs:
        rows, targets, owners = [], [], []
        offset = 0  # where each sequence's tokens start in the packed row
        for seq, n in scheduled:
            if seq.needs_prompt_logprobs:
                start = seq.num_computed_tokens
                for p in range(start, min(start + n, seq.num_prompt_tokens - 1)):
                    rows.append(offset + p - start)
                    targets.append(seq.prompt_token_ids[p + 1])
                    owners.append((seq, p + 1))
            offset += n
        return cls(rows, targets, owners)

    def compute(self, logits: torch.Tensor) -> None:
        """(R, V) raw logits of self.rows -> the logprob tensors, still on the device."""
        n = max(seq.params.prompt_logprobs for seq, _ in self.owners)
        self.tensors = LogprobsTensors.of(logits, to_device(self.targets, torch.long, logits.device), n)


def read_back(out: Sampled | None, seqs: list[Sequence], prompt: PromptLogprobs) -> list[int]:
    """The step's one device -> host read: the (M,) ids of `seqs`, returned, and the logprobs asked for,
    put onto their sequences (seq.output_logprobs, seq.prompt_logprobs)."""
    sampled = None if out is None else out.logprobs
    extras = (sampled.parts() if sampled is not None else []) + (prompt.tensors.parts() if prompt.rows else [])
    if not extras:
        return [] if out is None else out.ids.tolist()  # the one host read
    parts = ([] if out is None else [out.ids]) + extras
    flat = torch.cat([t.flatten().double() for t in parts]).tolist()  # the one host read
    ids = [int(i) for i in flat[:len(seqs)]]
    at = len(seqs)
    if sampled is not None:
        rows = out.logprob_rows.rows
        logprobs, at = sampled.unpack(flat, at, [ids[r] for r in rows], [seqs[r].params.logprobs for r in rows])
        for row, logprob in zip(rows, logprobs, strict=True):
            seqs[row].output_logprobs.append(logprob)
    if prompt.rows:
        wants = [seq.params.prompt_logprobs for seq, _ in prompt.owners]
        logprobs, _ = prompt.tensors.unpack(flat, at, prompt.targets, wants)
        for (seq, position), logprob in zip(prompt.owners, logprobs, strict=True):
            seq.prompt_logprobs[position] = logprob
    return ids
