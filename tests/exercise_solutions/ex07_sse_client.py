"""Exercise answered by the code the project's server work uses: server/app.py's `sse` frames the events; the
official `openai` client's SSE decoder (what tests/test_server.py talks through) reads them back;
benchmarks/bench_server.py's `Result` gives TPOT, and TTFT / ITL are its `one_request` arithmetic on the chunks'
arrival times."""

import math
import sys
from pathlib import Path

from openai import _streaming as streaming

from mini_transformer.server.app import sse as sse_event

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_server  # noqa: E402


def parse_sse(body):
    chunks = []
    for event in streaming.SSEDecoder().iter_bytes(iter([body.encode()])):
        if event.data == "[DONE]":
            return chunks
        chunks.append(event.json())
    raise ValueError("the stream ended without data: [DONE]")


def latency_metrics(sent_at, text_chunk_times, output_tokens):
    if not text_chunk_times:
        raise ValueError("no chunk with text")
    result = bench_server.Result(sent_at=sent_at, done_at=text_chunk_times[-1], output_tokens=output_tokens)
    result.ttft = text_chunk_times[0] - sent_at
    result.itls = [b - a for a, b in zip(text_chunk_times, text_chunk_times[1:], strict=False)]
    result.e2e = result.done_at - sent_at
    tpot = result.tpot
    return {"ttft": result.ttft, "itls": result.itls, "e2e": result.e2e, "tpot": None if math.isnan(tpot) else tpot}


__all__ = ["latency_metrics", "parse_sse", "sse_event"]
