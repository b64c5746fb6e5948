"""Exercise (docs/07 section 2): stream a choice's text, cutting it at stop strings.

Fill in `IncrementalText.add`, then grade it:

    uv run pytest exercises/test_ex07_stop_strings.py

The server hands a choice's new token ids to `add` as the engine produces them (one or several at a
time) and sends back whatever text `add` returns. The rules (OpenAI's, and the project's):
  - the text is `codec.decode(all ids so far)`; `add` returns only the part not returned before;
  - stop strings are looked for after EACH token, as if the ids came one at a time: after the first token
    with which the text contains a stop string, the text is cut just before the earliest one, `stopped`
    becomes True, and every later call returns '';
  - the stop string itself is never returned, so the last `hold` = (longest stop string - 1) characters
    are held back until they can no longer begin a stop string (or `final` is True: send them all);
  - text that ends in U+FFFD (half of a multi-byte character) waits for the next token.
`out` is everything returned so far.
"""

from __future__ import annotations


class IncrementalText:
    def __init__(self, codec, stop: list[str]):
        self.codec, self.stop = codec, stop  # codec.decode(list of ids) -> str
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already returned
        self.out = ""
        self.stopped = False

    def add(self, new_ids: list[int], final: bool) -> str:
        """Take the new ids; return the text that is now safe to send ('' if none)."""
        # TODO 1: after a stop nothing more is ever sent
        # TODO 2: a stop string must end the text at the token that completed it, even when one call
        #         brings several tokens; the text sent ends before the earliest stop string
        # TODO 3: never send characters that might still turn out to be the start of a stop string, or
        #         half of a character still being decoded; at the end everything left goes out
        # TODO 4: each call returns only text not sent before
        raise NotImplementedError("TODO: exercise ex07_stop_strings, stop strings")
