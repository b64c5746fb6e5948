"""Text in and text out: the checkpoint's tokenizer, the chat template, and a detokenizer that turns a
growing list of token ids into text pieces for a stream, cutting at stop strings.

Chat template: a Hugging Face directory whose tokenizer_config.json has `chat_template` is rendered with
Jinja exactly as `transformers` does (a sandboxed environment, trim_blocks and lstrip_blocks, the
variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and `raise_exception`).
Without one, the documented plain template `CHAT_TEMPLATE` (tokenizer.py, which saves it with every
tokenizer) is used:

    System: You are terse.
    User: Hello
    Assistant:

(one line per message, `Role: content`, and a final `Assistant:` that the model continues).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..tokenizer import CHAT_TEMPLATE, IncrementalDecoder, load_tokenizer
from .protocol import ErrorResponse


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TextCodec:
    """A checkpoint directory's tokenizer, end-of-sequence id and chat template."""

    def __init__(self, checkpoint: str | Path):
        path = Path(checkpoint)
        self.tokenizer = load_tokenizer(path)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        self.chat_template_source = template or CHAT_TEMPLATE
        # the tokenizer's own BOS/EOS for a checkpoint saved before its files named them (the newline of a
        # character vocabulary): lm-eval needs one of them to start its rolling windows
        bos_id = self.tokenizer.bos_token_id
        own_bos = None if bos_id is None else self.tokenizer.decode([bos_id])
        self.bos_token = _token_text(config.get("bos_token")) or own_bos or ""
        self.eos_token = _token_text(config.get("eos_token")) or self.tokenizer.eos_token or ""
        self.eos_token_id = self.tokenizer.eos_token_id  # where generation stops (load_tokenizer), as in the CLI
        self._template = None
        self._token_texts: dict[int, str] = {}

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        try:
            ids = self.tokenizer.encode(text)
        except ValueError as err:
            raise ErrorResponse(400, f"{param}: {err}", param=param) from None
        if not ids:
            raise ErrorResponse(400, f"{param} is empty; give at least one token of text", param=param)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        """One token decoded alone (logprobs name tokens this way); remembered, as the same ids recur."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template_source)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except ErrorResponse:
            raise
        except Exception as err:  # a template error is the caller's messages not fitting the template
            raise ErrorResponse(400, f"the chat template failed on these messages: {err}", param="messages") from None


def _raise_template_error(message: str):
    raise ErrorResponse(400, f"chat template: {message}", param="messages")


class IncrementalText:
    """The text of one choice, handed out piece by piece as its token ids grow.

    The tokenizer's IncrementalDecoder turns ids into text (it decodes only a trailing window, and text
    ending in an unfinished character waits for the next token). With stop strings, the tail that could
    still become a stop string is held back; after the first token with which the text contains a stop
    string, the text is cut just before the earliest one (OpenAI's rule), or just after it with
    `include_stop` (vLLM's include_stop_str_in_output). A stop string counts only if it ends in the text of
    a token at or past the first `min_tokens` (vLLM's rule: no stop before min_tokens tokens).
    `tokens_used` counts the ids that made the text: after a stop string, later ids are not part of it.
    """

    def __init__(self, codec: TextCodec, stop: list[str], include_stop: bool = False, min_tokens: int = 0):
        self.codec, self.stop = codec, stop
        self.include_stop, self.min_tokens = include_stop, min_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.decoder = IncrementalDecoder(codec)
        self.ids = self.decoder.ids  # the choice's token ids so far
        self.tokens_used = 0
        self.sent = 0  # characters of the text already handed out
        self.out = ""  # the text handed out so far (the choice's text when it ends)
        self.stopped = False  # a stop string was found: nothing more to send

    def add(self, new_ids: list[int], final: bool) -> str:
        """Take the new ids; return the text that is now safe to send ('' if none).

        Stop strings are looked for after each token, as if the ids came one at a time, so where a text
        is cut does not depend on how many tokens arrived together."""
        if self.stopped:
            return ""
        if self.stop:
            for token in new_ids:
                before = len(self.decoder.text)
                self.tokens_used += 1
                if self.decoder.add([token]) and self._cut_at(before) is not None:
                    return self._cut(before)
            before = len(self.decoder.text)
            if final and self.decoder.add([], final=True) and self._cut_at(before) is not None:
                return self._cut(before)  # the last, unfinished character flushed at the end
        else:
            self.tokens_used += len(new_ids)
            self.decoder.add(new_ids, final=final)
        text = self.decoder.text
        return self._emit(text, len(text) if final else len(text) - self.hold)

    def _cut_at(self, before: int) -> int | None:
        """Where the text ends if a stop string ends past character `before` (the text of the newest
        token): just before the earliest such stop string, or just after it with include_stop."""
        if self.tokens_used < self.min_tokens:
            return None
        text = self.decoder.text
        hits = []
        for s in self.stop:
            i = text.find(s, max(0, before - len(s) + 1))
            if i >= 0:
                hits.append((i, i + len(s)))
        if not hits:
            return None
        start, end = min(hits)
        return end if self.include_stop else start

    def _cut(self, before: int) -> str:
        self.stopped = True
        return self._emit(self.decoder.text, self._cut_at(before))

    def _emit(self, text: str, end: int) -> str:
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        self.out += piece
        return piece
