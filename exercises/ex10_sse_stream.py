"""Exercise 10 (docs/07): a streamed completion on the wire, and the text that is safe to send.

Fill in `sse_event` and `IncrementalText.add`, then grade them:

    uv run pytest exercises/test_ex10_sse_stream.py

A streamed response (`stream: true`) is a text/event-stream: each chunk is ONE event, the line
`data: <the chunk as JSON>` followed by a blank line, and the stream ends with the event `data: [DONE]`.
The text of a chunk comes from decoding token ids, and two things make that harder than it looks:
a character may need several tokens (a byte-level tokenizer decodes half a character as U+FFFD), and a
stop string must never reach the client, not even its first characters.
"""

from __future__ import annotations


def sse_event(payload: dict | str) -> str:
    """One server-sent event: 'data: ' + the payload + a blank line.

    A dict is written as JSON on ONE line (json.dumps escapes newlines inside strings); a str (the final
    '[DONE]') is written as it is.
    """
    # TODO 1: json.dumps a dict (keep the str as it is), then frame it as one `data: ` line and a blank line
    raise NotImplementedError("TODO: exercise 10, sse_event")


class IncrementalText:
    """The text of one choice, handed out piece by piece as its token ids grow.

    codec.decode(ids) -> str decodes a whole list of ids. `stop` lists the stop strings (maybe none).
    Rules of `add`:
      * decode ALL ids so far again (a character can span tokens) and send only the part not sent yet;
      * text ending in an unfinished character ('\ufffd') keeps that last character back until the next add;
      * with stop strings, keep back the last (longest stop's length - 1) characters: they might still
        become the start of a stop string;
      * look for stop strings after EACH new token, as if the ids came one at a time (so where the text
        is cut does not depend on how many tokens arrived together): at the first token after which the
        decoded text contains a stop string, send everything before its earliest occurrence, set
        `stopped`, and send nothing ever again (the stop string itself is never sent);
      * final=True (the last ids of the choice): nothing can follow, so send the rest.
    `out` is everything sent so far.
    """

    def __init__(self, codec, stop: list[str]):
        self.codec, self.stop = codec, stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already handed out
        self.out = ""
        self.stopped = False

    def add(self, new_ids: list[int], final: bool) -> str:
        """Take the new ids; return the text that is now safe to send ('' if none)."""
        # TODO 2: nothing after a stop. With stop strings, append the ids one by one, decoding all ids after
        #         each: the earliest stop string in that text -> send up to it, set stopped, return
        # TODO 3: (no stop seen) extend self.ids if not done yet and decode them all
        # TODO 4: otherwise the safe end: all of it when final, else hold back the tail (stop length - 1,
        #         and one more character if the text ends in '\ufffd'); send text[sent:end], update sent and out
        raise NotImplementedError("TODO: exercise 10, IncrementalText.add")
