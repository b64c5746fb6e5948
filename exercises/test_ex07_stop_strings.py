"""Grader for ex07_stop_strings: stop strings in a stream. Reference: generate the text one token at a time and
stop after the first token with which it contains a stop string (a plain loop over prefixes)."""

from __future__ import annotations

import random

EXERCISE = "ex07_stop_strings"


class Chars:
    """One id per character: decode is chr."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class Utf8Bytes:
    """One id per byte: a character of several bytes is U+FFFD until its last byte arrives."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def expected_text(text: str, stops: list[str]) -> str:
    for end in range(1, len(text) + 1):
        hits = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if hits:
            return text[:min(hits)]
    return text


def stream(solution, text: str, stops: list[str], chunk_sizes: list[int]) -> tuple[list[str], object]:
    ids = [ord(c) for c in text]
    s = solution.IncrementalText(Chars(), stops)
    pieces, start, k = [], 0, 0
    while start < len(ids):
        n = chunk_sizes[k % len(chunk_sizes)]
        k += 1
        pieces.append(s.add(ids[start:start + n], final=start + n >= len(ids)))
        start += n
    return pieces, s


def test_without_stop_strings_the_pieces_are_the_text(solution):
    pieces, s = stream(solution, "hello world", [], [1, 3, 2])
    assert "".join(pieces) == "hello world" == s.out and not s.stopped
    assert pieces[0] == "h", "with no stop strings nothing is held back"


def test_the_text_is_cut_before_the_stop_string(solution):
    pieces, s = stream(solution, "one. two. three", [". t"], [1])
    assert "".join(pieces) == "one" == s.out and s.stopped, "cut just before the stop string, which is not sent"
    assert all(". t"[:2] not in p for p in pieces)


def test_a_stop_string_split_over_chunks_is_never_half_sent(solution):
    for sizes in ([1], [2], [1, 2], [3, 1]):
        pieces, s = stream(solution, "abcSTOPdef", ["STOP"], sizes)
        assert "".join(pieces) == "abc" and s.stopped, f"chunks {sizes}: got pieces {pieces}"


def test_stops_are_checked_after_each_token_even_in_one_chunk(solution):
    # generating 'b', 'a' completes the stop string 'a' before 'baa' could ever appear
    pieces, s = stream(solution, "baa", ["a", "baa"], [3])
    assert "".join(pieces) == "b" and s.stopped, "the text must not depend on how many tokens came at once"
    assert s.add([ord("x")], final=True) == "", "after a stop, nothing more is sent"


def test_random_texts_match_the_one_token_at_a_time_reference(solution):
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 20)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 3))]
        sizes = [rng.randint(1, 4) for _ in range(3)]
        pieces, s = stream(solution, text, stops, sizes)
        assert "".join(pieces) == expected_text(text, stops) == s.out, f"text={text!r} stops={stops} sizes={sizes}"


def test_half_a_character_waits(solution):
    s = solution.IncrementalText(Utf8Bytes(), [])
    snowman = list("☃".encode())
    assert [s.add([b], final=False) for b in snowman] == ["", "", "☃"]
