"""Grader for exercise 10: SSE framing parsed back by hand, and the streamed text against a plain loop
that looks for stop strings after every token: where the text is cut must not depend on how many
tokens arrived together."""

from __future__ import annotations

import json
import random

EXERCISE = "ex10_sse_stream"


def test_an_event_is_one_data_line_and_a_blank_line(solution):
    chunk = {"id": "cmpl-1", "object": "text_completion",
             "choices": [{"index": 0, "text": "two\nlines, \"quoted\", 汉字", "finish_reason": None}]}
    event = solution.sse_event(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n"), f"not 'data: ...' + blank line: {event!r}"
    assert "\n" not in event[:-2], "the JSON must stay on one line (a raw newline would end the event early)"
    assert json.loads(event[len("data: "):-2]) == chunk, "the data line must be the chunk as JSON"
    assert solution.sse_event("[DONE]") == "data: [DONE]\n\n"


def test_a_stream_of_events_splits_back_into_its_chunks(solution):
    chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("Hel", "lo", "")]
    body = "".join(solution.sse_event(c) for c in chunks) + solution.sse_event("[DONE]")
    events = body[:-2].split("\n\n")  # what a client does: events are separated by blank lines
    assert events[-1] == "data: [DONE]", "the stream must end with data: [DONE]"
    assert [json.loads(e[len("data: "):]) for e in events[:-1]] == chunks


class CharCodec:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class ByteCodec:
    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def expected_text(text: str, stops: list[str]) -> tuple[str, bool]:
    """Reference, one token (here one character) at a time: the first token after which the text contains
    a stop string ends the choice, cut before that stop string's earliest occurrence.
    Returns (the text sent, stopped)."""
    for end in range(1, len(text) + 1):
        hits = [text[:end].find(s) for s in stops if s in text[:end]]
        if hits:
            return text[:min(hits)], True
    return text, False


def stream(solution, codec, ids, sizes, stops):
    text = solution.IncrementalText(codec, stops)
    pieces, start = [], 0
    for n in sizes:
        if start >= len(ids):
            break
        start += n
        pieces.append(text.add(ids[start - n:start], final=start >= len(ids)))
    return text, pieces


def test_pieces_join_to_the_text_cut_at_the_earliest_stop(solution):
    rng = random.Random(0)
    for case in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 24)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 3))]
        sizes = [rng.randint(1, 4) for _ in text]
        got, pieces = stream(solution, CharCodec(), [ord(c) for c in text], sizes, stops)
        want, stopped = expected_text(text, stops)
        assert "".join(pieces) == want, f"case {case}: text {text!r}, stops {stops}, sizes {sizes}: {pieces}"
        assert got.out == want, "out must be everything that was sent"
        assert got.stopped == stopped, f"case {case}: stopped should be {stopped}"


def test_a_stop_string_never_leaks_even_when_it_arrives_one_character_at_a_time(solution):
    text, pieces = stream(solution, CharCodec(), [ord(c) for c in "say STOP now"], [1] * 12, ["STOP"])
    assert "".join(pieces) == "say ", f"pieces {pieces}"
    assert text.stopped and text.add([ord("x")], final=True) == "", "nothing is sent after a stop"


def test_the_cut_does_not_depend_on_how_tokens_were_grouped(solution):
    ids, stops = [ord(c) for c in "xabcd"], ["bc", "abcd"]  # "bc" completes first, "abcd" starts earlier
    for sizes in ([1] * 5, [5], [2, 3]):
        _, pieces = stream(solution, CharCodec(), ids, sizes, stops)
        assert "".join(pieces) == "xa", f"ids in groups of {sizes}: generation ends as 'bc' completes -> 'xa'"


def test_text_is_sent_as_soon_as_it_is_safe(solution):
    ids = [ord(c) for c in "abcdefgh"]
    plain = solution.IncrementalText(CharCodec(), [])
    assert [plain.add([i], final=False) for i in ids] == list("abcdefgh"), "no stop strings: nothing to hold"
    held = solution.IncrementalText(CharCodec(), ["xyz"])
    sent = 0
    for k, i in enumerate(ids, start=1):
        sent += len(held.add([i], final=False))
        assert sent >= k - 2, f"after {k} characters only {sent} sent: hold back at most len('xyz') - 1"
    assert held.add([], final=True) == "gh", "final: the held-back tail goes out"


def test_an_unfinished_character_waits_for_its_last_byte(solution):
    snowman = list("☃".encode())  # three bytes, three tokens
    text = solution.IncrementalText(ByteCodec(), [])
    assert text.add(snowman[:1], final=False) == "", "half a character (U+FFFD) must wait"
    assert text.add(snowman[1:2], final=False) == ""
    assert text.add(snowman[2:] + [ord("!")], final=True) == "☃!"
