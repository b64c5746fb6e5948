"""Exercise (docs/07 sections 2 and 7): a streamed completion on the wire, read back by a client that
times it.

Fill in `sse_event`, `parse_sse` and `latency_metrics`, then grade them:

    uv run pytest exercises/test_ex07_sse_client.py

A streamed response (`stream: true`) is a text/event-stream. Each chunk is ONE event: the line
`data: <the chunk as JSON>` and then a blank line; the stream ends with the event `data: [DONE]`.
A line starting with ':' is a comment (servers send them to keep a quiet connection open).
From the arrival time of each chunk, a benchmark client computes (as vLLM's benchmark_serving does):
  TTFT  time to first token  = first chunk with text - request sent
  ITL   inter-token latency  = the gaps between consecutive chunks with text (one per gap)
  E2E   end to end           = last chunk with text - request sent
  TPOT  time per output token = (E2E - TTFT) / (output tokens - 1): per TOKEN, so a chunk that carries
        several tokens counts them all (ITL, per chunk, does not)
"""

from __future__ import annotations


def sse_event(payload: dict | str) -> str:
    """One server-sent event: 'data: ' + the payload + a blank line. A dict is written as JSON on ONE line
    (json.dumps escapes newlines inside strings); a str (the final '[DONE]') is written as it is."""
    # TODO 1: one event whose data stays on one line, ended so that a reader sees where it stops
    raise NotImplementedError("TODO: exercise ex07_sse_client, sse_event")


def parse_sse(body: str) -> list[dict]:
    """The chunks of a whole stream body, in order (each `data:` payload parsed as JSON), up to `[DONE]`.

    Events are separated by a blank line; ':' comment lines are skipped. A body that ends without
    `data: [DONE]` was cut off (the server died, a proxy timed out): raise ValueError, so that a
    truncated answer is never taken for a complete one."""
    # TODO 2: every data payload up to the end marker; a stream without the marker is not an answer
    raise NotImplementedError("TODO: exercise ex07_sse_client, parse_sse")


def latency_metrics(sent_at: float, text_chunk_times: list[float], output_tokens: int) -> dict:
    """-> {"ttft", "itls", "e2e", "tpot"} in seconds, from when the request was sent, when each chunk
    carrying text arrived, and the number of tokens generated (the usage chunk's completion_tokens).
    tpot is None when only one token came out. No chunk with text: ValueError."""
    # TODO 3: the four numbers as the docstring defines them; mind what TPOT divides by
    raise NotImplementedError("TODO: exercise ex07_sse_client, latency_metrics")
