"""Log-probabilities in OpenAI's two JSON shapes.

The engine hands out, per token, a `TokenLogprob(token_id, logprob, top)` of the RAW model distribution
(log_softmax of the logits before any penalty, bias or temperature; vLLM's convention), `top` being the
N most likely (id, logprob) pairs. The first prompt token has no logprob (nothing comes before it): its
entry is None. Here a token is a `Scored(token_id, logprob | None, top)` and becomes

  /v1/completions       {"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
                         "text_offset": [int]}                      (the chosen token is always in its top dict)
  /v1/chat/completions  {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

With prompt_logprobs=N (vLLM's field, /v1/completions) each choice also gets vLLM's list: None for the
first prompt token, then per token {str(token id): {"logprob", "rank", "decoded_token"}} for the N most
likely and the prompt token itself; rank counts from 1 among the N, and is null for a prompt token
outside them (the engine keeps no rank past the top N).

JSON has no -inf, so a logprob is clamped at -9999.0 (as vLLM does). A token's string is the tokenizer's
decoding of that token alone (for byte-level BPE it may be a piece of a character: U+FFFD), and
text_offset is the running sum of those strings' lengths, which equals the true offset in the text
whenever every token decodes to whole characters (always for the character tokenizer).
"""

from __future__ import annotations

from typing import NamedTuple

LOGPROB_FLOOR = -9999.0


class Scored(NamedTuple):
    token_id: int
    logprob: float | None  # None: the first prompt token
    top: tuple[tuple[int, float], ...] = ()


def scored(token_ids: list[int], entries) -> list[Scored]:
    """Pair token ids with the engine's TokenLogprob entries (an entry may be None: no logprob)."""
    assert len(token_ids) == len(entries), (len(token_ids), len(entries))
    out = []
    for token, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            out.append(Scored(token, None))
        else:
            assert entry.token_id == token, (entry.token_id, token)
            out.append(Scored(token, float(entry.logprob), tuple((int(i), float(lp)) for i, lp in entry.top)))
    return out


def clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class CompletionLogprobs:
    """One choice's completions-style logprobs, built up token by token (a stream sends each part)."""

    def __init__(self, token_text):
        self.token_text = token_text  # id -> its string
        self.offset = 0

    def part(self, tokens: list[Scored]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token in tokens:
            text = self.token_text(token.token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if token.logprob is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(clamp(token.logprob))
            top = {self.token_text(i): clamp(lp) for i, lp in token.top}
            top.setdefault(text, clamp(token.logprob))  # the chosen one is always there (vLLM's rule)
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(tokens: list[Scored], token_text) -> dict:
    """{"content": [...]} for chat; every token here is a generated one, so each has a logprob."""

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": clamp(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t.token_id, t.logprob), "top_logprobs": [item(i, lp) for i, lp in t.top]}
                        for t in tokens]}


def prompt_logprobs_json(tokens: list[Scored], n: int, token_text) -> list[dict | None]:
    """vLLM's prompt_logprobs of one prompt: the n most likely tokens at each position, and the prompt's."""

    def entry(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": clamp(logprob), "rank": rank, "decoded_token": token_text(token_id)}

    out: list[dict | None] = []
    for token in tokens:
        if token.logprob is None:
            out.append(None)
            continue
        at = {str(i): entry(i, lp, rank) for rank, (i, lp) in enumerate(token.top[:n], start=1)}
        at.setdefault(str(token.token_id), entry(token.token_id, token.logprob, None))
        out.append(at)
    return out
