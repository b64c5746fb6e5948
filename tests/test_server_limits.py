"""What one request may cost (server/limits.py): past each limit a 400 names it, and while a heavy request
is refused or compiled the event loop keeps answering others (/health timed beside it).

Reference for the nesting depth: a plain recursive count. The timing bound on /health is generous (1 s,
the machine may be loaded); the point is that it answers while the heavy request is in flight.
"""

import gc
import json
import threading
import time
from typing import Annotated

import httpx
import pytest
from pydantic import BaseModel, BeforeValidator, TypeAdapter
from server_support import make_char_checkpoint, running_server, slowed_engine

from mini_transformer.engine import EngineConfig
from mini_transformer.server.limits import Limits, Workers, nesting_depth, parse_body
from mini_transformer.server.protocol import MAX_CHAT_MESSAGES, ErrorResponse

MODEL = "tiny"
HEALTH_BOUND_S = 1.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-char")
    make_char_checkpoint(path, max_seq_len=64)
    limits = Limits(max_body_bytes=4 * 2**20, max_prompt_bytes=2**16, grammar_compile_timeout_s=0.001)
    with running_server(path, config=EngineConfig(block_size=4, num_blocks=128, max_num_seqs=8), model_name=MODEL,
                        limits=limits) as server:
        yield server


def health_while(served, request) -> tuple[httpx.Response, list[float]]:
    """Send `request` (a function of an httpx.Client) in a thread; time /health until it returns."""
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(r=request(httpx.Client(base_url=served.url, timeout=120))))
    times = []
    with httpx.Client(base_url=served.url, timeout=30) as client:
        thread.start()
        deadline = time.monotonic() + 120
        while thread.is_alive() or not times:
            began = time.monotonic()
            assert client.get("/health").status_code == 200
            times.append(time.monotonic() - began)
            assert time.monotonic() < deadline
            time.sleep(0.01)
    thread.join()
    return answer["r"], times


def refused(response: httpx.Response, param, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


def test_a_hundred_thousand_choices_are_refused_while_health_answers(served):
    choices = [f"option {i}" for i in range(100_000)]
    response, times = health_while(served, lambda c: c.post("/v1/completions", json=completion(guided_choice=choices)))
    refused(response, "guided_choice", "--max-guided-choices")
    assert max(times) < HEALTH_BOUND_S, times


def test_an_open_stream_keeps_flowing_while_a_heavy_request_is_refused(served):
    body = completion(prompt="Keep going", max_tokens=50, stream=True, ignore_eos=True)  # fits the 64-token context
    heavy = completion(guided_choice=[f"option {i}" for i in range(100_000)])
    arrivals: list[float] = []
    with slowed_engine(served, 0.1), httpx.Client(base_url=served.url, timeout=60) as client, \
            client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the stream runs
        answer: dict = {}
        thread = threading.Thread(target=lambda: answer.update(r=httpx.post(served.url + "/v1/completions",
                                                                             json=heavy, timeout=120),
                                                                at=time.monotonic()))
        thread.start()
        for line in lines:  # bounded: the request has 50 tokens; read to its end
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
        thread.join()
        heavy_done = answer["at"]
    refused(answer["r"], "guided_choice", "--max-guided-choices")
    assert arrivals[-1] > heavy_done, "the stream ended before the heavy request was refused"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert max(gaps) < HEALTH_BOUND_S, gaps


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_schema_nested_deeper_than_the_limit_is_refused(served):
    schema = nested_schema(100)  # past the schema depth limit, within the body parser's
    refused(httpx.post(served.url + "/v1/completions", json=completion(guided_json=schema), timeout=60),
            "guided_json", "--max-schema-depth")
    as_text = json.dumps(nested_schema(310))  # a schema sent as JSON text: its own parse is bounded
    refused(httpx.post(served.url + "/v1/completions", json=completion(guided_json=as_text), timeout=60),
            "guided_json", "--max-schema-depth")


def test_a_body_nested_past_the_parser_limit_is_refused(served):
    response = httpx.post(served.url + "/v1/completions", json=completion(guided_json=nested_schema(310)), timeout=60)
    assert response.status_code == 400 and "too deeply" in response.json()["error"]["message"], response.text
    deep = b'{"model": "tiny", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = httpx.post(served.url + "/v1/completions", content=deep, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "too deeply" in response.json()["error"]["message"], response.text


def test_a_large_body_is_parsed_while_health_answers(served):
    """A body near the size limit whose validation takes long on one thread (a few million token ids, each
    checked): parsed on a worker, the event loop answers /health meanwhile; then the 400 names the prompt."""
    ids = b",".join([b"1"] * (served.ctx.limits.max_body_bytes // 2 - 64))
    body = b'{"model": "tiny", "max_tokens": 1, "prompt": [' + ids + b"]}"
    assert len(body) <= served.ctx.limits.max_body_bytes
    response, times = health_while(served, lambda c: c.post("/v1/completions", content=body,
                                                            headers={"content-type": "application/json"}))
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert len(times) > 1 and max(times) < HEALTH_BOUND_S, times


def test_a_chat_of_too_many_messages_is_refused_while_health_answers(served):
    """Tens of thousands of chat messages in one body: each would become a model object holding the GIL;
    the list is refused past MAX_CHAT_MESSAGES, on the worker, while /health answers."""
    messages = [{"role": "user", "content": "hi"}] * 60_000
    body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": messages}).encode()
    assert len(body) <= served.ctx.limits.max_body_bytes
    response, times = health_while(served, lambda c: c.post("/v1/chat/completions", content=body,
                                                            headers={"content-type": "application/json"}))
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text
    assert str(MAX_CHAT_MESSAGES) in response.json()["error"]["message"]
    assert len(times) > 1 and max(times) < HEALTH_BOUND_S, times
    few = {"model": MODEL, "max_tokens": 1, "messages": messages[:MAX_CHAT_MESSAGES]}
    response = httpx.post(served.url + "/v1/chat/completions", json=few, timeout=60)  # at the cap: not refused for it
    assert response.status_code == 200 or str(MAX_CHAT_MESSAGES) not in response.json()["error"]["message"], \
        response.text


def test_bodies_are_validated_as_before(served):
    for body, param in (({"model": MODEL, "prompt": "hi", "n": "1"}, "n"), ({"model": MODEL}, "prompt"),
                        ([1, 2], None)):
        response = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    response = httpx.post(served.url + "/v1/completions", content=b'{"model": ', timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(served.url + "/v1/completions", content=json.dumps(completion()), timeout=60,
                          headers={"content-type": "text/plain"})
    assert response.status_code == 400 and "Content-Type" in response.json()["error"]["message"]
    response = httpx.post(served.url + "/tokenize", json={"prompt": "hi", "return_token_strs": "yes"}, timeout=60)
    assert response.status_code == 400, response.text


def test_a_large_constraint_is_refused_by_its_size(served):
    regex = "(a|b)" * 20_000  # 100 KB of regex
    refused(httpx.post(served.url + "/v1/completions", json=completion(guided_regex=regex), timeout=60),
            "guided_regex", "--max-schema-bytes")


def test_a_compile_past_the_timeout_is_refused_while_health_answers(served):
    chars = [c for c in served.ctx.codec.tokenizer.chars if c.isalpha()]
    choices = [f"{chars[i % len(chars)]}{chars[i // len(chars) % len(chars)]}{i}" for i in range(1000)]
    choices = ["".join(c for c in choice if c in served.ctx.codec.tokenizer.chars) for choice in choices]
    response, times = health_while(served, lambda c: c.post("/v1/completions",
                                                            json=completion(guided_choice=sorted(set(choices)))))
    refused(response, "guided_choice", "--grammar-compile-timeout")
    assert max(times) < HEALTH_BOUND_S, times


def test_prompts_past_the_byte_limits_are_refused_before_tokenising(served):
    big = "a" * (2**16 + 1)
    refused(httpx.post(served.url + "/v1/completions", json=completion(prompt=big), timeout=60),
            "prompt", "--max-prompt-bytes")
    refused(httpx.post(served.url + "/v1/completions", json=completion(prompt=["hi", big]), timeout=60),
            "prompt[1]", "--max-prompt-bytes")
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": big}]}
    refused(httpx.post(served.url + "/v1/chat/completions", json=chat, timeout=60), "messages", "--max-prompt-bytes")
    refused(httpx.post(served.url + "/tokenize", json={"prompt": big}, timeout=60), "prompt", "--max-prompt-bytes")


def test_a_body_past_the_limit_is_refused_declared_or_chunked(served):
    ten_mb = json.dumps(completion(prompt="a" * 10 * 2**20)).encode()
    response = httpx.post(served.url + "/v1/completions", content=ten_mb, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "--max-body-bytes" in response.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for start in range(0, len(ten_mb), 2**16):
            yield ten_mb[start:start + 2**16]

    response = httpx.post(served.url + "/v1/completions", content=chunks(), timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "--max-body-bytes" in response.json()["error"]["message"]
    good = httpx.post(served.url + "/v1/completions", json=completion(), timeout=60)
    assert good.status_code == 200, good.text


def test_the_garbage_collector_is_paused_while_a_body_is_parsed():
    """Paused during validation (a validator sees it off), restored after, also after a refused body; a
    collector someone else turned off stays off."""
    seen = []

    class Probe(BaseModel):
        x: Annotated[int, BeforeValidator(lambda v: seen.append(gc.isenabled()) or v)]

    adapter = TypeAdapter(Probe)
    assert gc.isenabled()
    assert parse_body(adapter, b'{"x": 1}', "application/json").x == 1
    assert seen == [False] and gc.isenabled()
    with pytest.raises(ErrorResponse):
        parse_body(adapter, b'{"x": "one"}', None)
    assert gc.isenabled()
    gc.disable()
    try:
        parse_body(adapter, b'{"x": 2}', "application/json")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_shutdown_waits_for_running_work_and_drops_queued_work():
    """A compile still running when the server stops (its first one imports xgrammar for seconds) is
    finished before shutdown returns, so no thread of the server outlives it; queued work never starts."""
    workers, started, finished = Workers(Limits(workers=1)), threading.Event(), []

    def slow(name):
        started.set()
        time.sleep(0.3)
        finished.append(name)

    workers.compile_pool.submit(slow, "running")
    workers.compile_pool.submit(slow, "queued")
    assert started.wait(10)
    workers.shutdown()
    assert finished == ["running"]


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


@pytest.mark.parametrize("value", [1, "x", [], {}, [1, [2, [3]]], {"a": {"b": [1, {"c": None}]}, "d": []},
                                   [[[[[]]]], {"x": [{}]}]])
def test_nesting_depth_matches_the_recursive_count(value):
    assert nesting_depth(value) == _depth(value)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_schema_depth"):
        Limits(max_schema_depth=0)
    with pytest.raises(ValueError, match="grammar_compile_timeout_s"):
        Limits(grammar_compile_timeout_s=-1)
