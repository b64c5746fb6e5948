"""Grader for ex07_sse_client: SSE framing read back by hand (split on blank lines, json.loads), truncated
and commented streams, and the latency metrics against numbers worked out by hand."""

from __future__ import annotations

import json

EXERCISE = "ex07_sse_client"

CHUNK = {"id": "cmpl-1", "object": "text_completion",
         "choices": [{"index": 0, "text": "two\nlines, \"quoted\", 汉字", "finish_reason": None}]}


def test_an_event_is_one_data_line_and_a_blank_line(solution):
    event = solution.sse_event(CHUNK)
    assert event.startswith("data: ") and event.endswith("\n\n"), f"not 'data: ...' + a blank line: {event!r}"
    assert "\n" not in event[:-2], "the JSON must stay on one line (a raw newline would end the event early)"
    assert json.loads(event[len("data: "):-2]) == CHUNK, "the data line must be the chunk as JSON"
    assert solution.sse_event("[DONE]") == "data: [DONE]\n\n"


def test_events_in_a_row_split_back_into_their_chunks(solution):
    chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("Hel", "lo", "")]
    body = "".join(solution.sse_event(c) for c in chunks) + solution.sse_event("[DONE]")
    events = body[:-2].split("\n\n")  # what a client does: a blank line ends an event
    assert events[-1] == "data: [DONE]", "the stream ends with data: [DONE]"
    assert [json.loads(e[len("data: "):]) for e in events[:-1]] == chunks


def test_parse_reads_chunks_up_to_done_and_skips_comments(solution):
    chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("a", "b\n", "")]
    body = (": keep-alive\n\n" + "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + ": quiet\n\n"
            + "data: [DONE]\n\n")
    assert solution.parse_sse(body) == chunks


def raises_value_error(function, *args) -> bool:
    """(not pytest.raises: a grader reports every miss as an AssertionError, see tests/test_exercises.py)"""
    try:
        function(*args)
    except ValueError:
        return True
    return False


def test_a_stream_cut_off_before_done_is_an_error(solution):
    whole = f"data: {json.dumps(CHUNK)}\n\ndata: [DONE]\n\n"
    assert solution.parse_sse(whole) == [CHUNK]
    for cut in (f"data: {json.dumps(CHUNK)}\n\n", ""):
        assert raises_value_error(solution.parse_sse, cut), (
            f"no [DONE] in {cut!r}: the stream was cut off, parse_sse must raise ValueError")


def close(a, b):
    return abs(a - b) < 1e-9


def test_latency_metrics(solution):
    # sent at 10.0; chunks with text at 10.5, 10.7, 11.0, 11.6; the third chunk carried 3 tokens: 6 in all
    m = solution.latency_metrics(10.0, [10.5, 10.7, 11.0, 11.6], 6)
    assert close(m["ttft"], 0.5), f"ttft = first chunk - sent = 0.5, got {m['ttft']}"
    assert len(m["itls"]) == 3 and all(close(a, b) for a, b in zip(m["itls"], [0.2, 0.3, 0.6], strict=True)), (
        f"itls = gaps between chunks [0.2, 0.3, 0.6], got {m['itls']}")
    assert close(m["e2e"], 1.6), f"e2e = last chunk - sent = 1.6, got {m['e2e']}"
    assert close(m["tpot"], 1.1 / 5), f"tpot = (e2e - ttft) / (tokens - 1) = 1.1 / 5 (per token), got {m['tpot']}"


def test_latency_metrics_of_a_single_token(solution):
    m = solution.latency_metrics(2.0, [2.25], 1)
    assert close(m["ttft"], 0.25) and close(m["e2e"], 0.25) and m["itls"] == []
    assert m["tpot"] is None, "one token: no gap to average, tpot is None (not 0, not a division by zero)"
    assert raises_value_error(solution.latency_metrics, 2.0, [], 0), "no chunk with text: ValueError"
