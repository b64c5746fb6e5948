"""Structured output in the engine, on xgrammar: a grammar becomes a token mask per step.

    manager = StructuredOutputManager(tokenizer, vocab_size, eos_token_id)  # TokenizerInfo + compiler, once
    matcher = manager.matcher(params.structured)   # compiled once per grammar (cached), a matcher per sequence
    masks = GrammarMasks(vocab_size, device)       # in the Sampler
    masks.prepare(seqs)        # before the forward: start filling the bitmask rows of the constrained sequences
    logits = masks.apply(logits, seqs)             # after it: -inf where the grammar says no

Why the mask can be filled before the forward: it depends only on the tokens a sequence has accepted,
which are known when the step is planned. So `prepare` fills it on a worker thread (xgrammar releases the
GIL) while the model runs, and `apply` usually finds it ready. On a GPU the forward is asynchronous
anyway; on the CPU the thread is what makes the two overlap.

The matcher advances in Sequence.append_token, once per accepted token. Nothing else changes it:
preemption here recomputes (the sequence keeps its tokens, so its matcher stays where it was), and a
prefix-cache hit only spares the prompt's K/V. A matcher is never rolled back, because a token the engine
appended is never taken back (speculative decoding, which would, is refused for constrained requests).

The vocabulary handed to xgrammar is each token's RAW bytes (VocabType.RAW): a char token's UTF-8, a
byte-level BPE token's bytes after undoing GPT-2's byte -> unicode mapping. The EOS token is xgrammar's
stop token: allowed only where the grammar may end. A vocabulary with no EOS ends the output at the first
point the grammar is complete (terminate_without_stop_token).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..inference.structured import StructuredOutput


class GrammarError(ValueError):
    """A constraint that does not compile (or cannot run with this engine); `argument` names it."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: the printable character standing for each byte -> the byte.
    Bytes that are printable Latin-1 stand for themselves; the other 68 are shifted to U+0100 upwards."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in kept]
    table = {chr(b): b for b in kept}
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


def token_bytes(tokenizer) -> list[bytes]:
    """Every token's raw bytes, by id: what xgrammar's VocabType.RAW expects. Special tokens other than
    EOS become b"" (xgrammar never allows an empty token, so the grammar cannot emit them). A plain list
    of token strings (a toy vocabulary, as in exercise 17) is taken as their UTF-8."""
    if isinstance(tokenizer, list | tuple) and all(isinstance(t, str) for t in tokenizer):
        return [t.encode("utf-8") for t in tokenizer]
    if getattr(tokenizer, "kind", None) == "char":
        return [c.encode("utf-8") for c in tokenizer.chars]
    if getattr(tokenizer, "kind", None) != "bpe":
        raise GrammarError("structured", f"structured output needs our char or BPE tokenizer, got {tokenizer!r}")
    backend = tokenizer.tokenizer
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        raise GrammarError("structured", "structured output supports byte-level BPE vocabularies (GPT-2's "
                                         f"scheme); this tokenizer's decoder is {decoder.get('type')!r}")
    to_byte = byte_level_decoder()
    special = {i for i, added in backend.get_added_tokens_decoder().items() if added.special}
    vocab = []
    for i in range(backend.get_vocab_size()):
        token = backend.id_to_token(i)
        if i in special:
            vocab.append(token.encode("utf-8") if i == tokenizer.eos_token_id else b"")
        else:
            vocab.append(bytes(to_byte[c] for c in token))
    return vocab


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose only sentences are the choices: root ::= "a" | "b" (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredOutputManager:
    """xgrammar's TokenizerInfo and GrammarCompiler for one engine, and the compiled grammars, cached by
    the StructuredOutput value (equal schemas compile once). Thread-safe: a server's HTTP thread compiles
    at the door while the engine thread steps."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, cache_size: int = 128):
        import xgrammar as xgr

        vocab = token_bytes(tokenizer)
        if len(vocab) > vocab_size:
            raise GrammarError("structured", f"the tokenizer has {len(vocab)} tokens, the model only {vocab_size}")
        stops = [] if eos_token_id is None else [eos_token_id]
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)  # our cache instead
        self.ends_without_stop = eos_token_id is None
        self.cache_size = cache_size
        self.compiled: OrderedDict[StructuredOutput, object] = OrderedDict()  # LRU: the newest at the end
        self.num_compiled = 0  # compilations done (a cache hit does not count)
        self._lock = threading.Lock()

    def compile(self, structured: StructuredOutput):
        """The CompiledGrammar for a constraint, from the cache or compiled now; GrammarError naming the
        field (json_schema, regex, grammar, ...) when xgrammar cannot compile it, or when no token of this
        vocabulary can even begin it (a character vocabulary without "{" and a JSON schema, say)."""
        with self._lock:
            if structured in self.compiled:
                self.compiled.move_to_end(structured)
                return self.compiled[structured]
        compiled = self._compile(structured)
        if not self._can_start(compiled):
            kind = structured.kind
            raise GrammarError(kind, f"{kind}: no token of this vocabulary can begin it (the vocabulary lacks the "
                                     "characters it needs; a byte-level BPE vocabulary spells any text)")
        with self._lock:
            self.compiled[structured] = compiled
            self.num_compiled += 1
            while len(self.compiled) > self.cache_size:
                self.compiled.popitem(last=False)
        return compiled

    def _compile(self, structured: StructuredOutput):
        kind, compiler = structured.kind, self.compiler
        try:
            if kind == "json_schema":  # compact JSON: no free whitespace for a model to wander in
                return compiler.compile_json_schema(structured.json_schema, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(structured.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(structured.choice))
            return compiler.compile_grammar(structured.grammar)
        except (RuntimeError, ValueError, TypeError) as err:  # xgrammar's parse errors: "[time] file.cc:line: message"
            reason = str(err).strip().splitlines()[-1].split(": ", 1)[-1]
            raise GrammarError(kind, f"{kind} does not compile: {reason}") from None

    def _can_start(self, compiled) -> bool:
        """Does the first step's mask allow any token? (Checked once per grammar, at compile time.)"""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.info.vocab_size)
        xgr.GrammarMatcher(compiled, terminate_without_stop_token=self.ends_without_stop).fill_next_token_bitmask(
            bitmask, 0)
        logits = torch.zeros(1, self.info.vocab_size)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.info.vocab_size)
        return bool(torch.isfinite(logits).any())

    def matcher(self, structured: StructuredOutput):
        """A fresh GrammarMatcher for one sequence (it has accepted nothing yet)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(structured), terminate_without_stop_token=self.ends_without_stop)


class GrammarMasks:
    """The per-step bitmask of the constrained rows, and applying it. Rows without a constraint are not
    touched (a batch without any costs one list comprehension). `timings` adds up, in seconds: `fill`
    (xgrammar filling the rows), `wait` (the sampler waiting for the mask: the part of the fill the forward
    did not hide; all of it when serial), `apply` (the -inf fill on the logits); `steps` counts masked steps.
    overlap=False fills the mask in apply(), after the forward (the serial way, to measure against)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.bitmask: torch.Tensor | None = None  # (rows, ceil(V / 32)) int32 on the CPU, grown as needed
        self.pending: Future | None = None
        self._worker: ThreadPoolExecutor | None = None
        self.timings = dict(fill=0.0, wait=0.0, apply=0.0, steps=0)
        self.overlap = True

    def prepare(self, seqs: list) -> None:
        """Called before the forward with the sequences that sample this step: start filling their rows."""
        self.pending = None
        jobs = self._jobs(seqs) if self.overlap else []
        if jobs:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
            self.pending = self._worker.submit(self._fill, jobs)

    def _jobs(self, seqs: list) -> list:
        """(row, matcher) of the constrained rows; the bitmask grown to hold every row of `seqs`."""
        jobs = [(row, seq.grammar) for row, seq in enumerate(seqs) if seq.grammar is not None]
        if jobs and (self.bitmask is None or self.bitmask.shape[0] < len(seqs)):
            import xgrammar as xgr

            self.bitmask = xgr.allocate_token_bitmask(max(len(seqs), 8), self.vocab_size)
        return jobs

    def _fill(self, jobs) -> list[int]:
        began = time.perf_counter()
        for row, matcher in jobs:
            matcher.fill_next_token_bitmask(self.bitmask, row)
        self.timings["fill"] += time.perf_counter() - began
        return [row for row, _ in jobs]

    def apply(self, logits: torch.Tensor, seqs: list) -> torch.Tensor:
        """(M, V) float logits, rows in the order of `seqs` -> the same tensor, with -inf on every token a
        constrained row's grammar forbids next. Without a fill under way (overlap off), fills it now."""
        import xgrammar as xgr

        began = time.perf_counter()
        if self.pending is not None:
            rows, self.pending = self.pending.result(), None
        else:
            rows = self._fill(self._jobs(seqs))  # serial: the whole fill is on the step's path
            if not rows:
                return logits
        ready = time.perf_counter()
        mask = self.bitmask[:len(seqs)]
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=rows)
        else:  # a fresh pinned copy per step: the next step's fill cannot race the transfer
            mask = mask.pin_memory().to(logits.device, non_blocking=True) if logits.is_cuda else mask.to(logits.device)
            xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=rows,
                                            backend="torch_native")
        done = time.perf_counter()
        self.timings["wait"] += ready - began
        self.timings["apply"] += done - ready
        self.timings["steps"] += 1
        return logits
