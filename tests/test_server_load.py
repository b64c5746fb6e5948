"""32 streaming clients at once: every response complete and equal to the offline engine's, no chunk lost
or repeated, and not one KV block held afterwards. The clients are asyncio tasks of one httpx client;
the whole run is bounded by a timeout and ends by itself."""

import asyncio
import json

import httpx
import pytest
from server_support import make_char_checkpoint, offline_greedy, running_server

from mini_transformer.engine import EngineConfig

N_CLIENTS = 32
TIMEOUT_S = 240  # a bound, not an expectation: ~5 s on an idle 2-core machine, 5x that at load 10


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-char-load")
    model, tokenizer = make_char_checkpoint(path, max_seq_len=64)
    # room for 32 requests at once, but only 8 run together: the rest wait and join as others leave
    with running_server(path,
                        config=EngineConfig(block_size=4, num_blocks=160, max_num_seqs=8, max_num_batched_tokens=64),
                        model_name="tiny", max_waiting=32) as server:
        server.model, server.tokenizer = model, tokenizer
        yield server


async def stream_one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, list[str]]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    pieces, finishes, done = [], [], False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done, line
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line[6:])["choices"][0]
            pieces.append(choice["text"])
            if choice["finish_reason"] is not None:
                finishes.append(choice["finish_reason"])
    assert done and finishes == ["length"]
    return "".join(pieces), pieces


async def run_clients(url: str, prompts: list[str], lengths: list[int]):
    limits = httpx.Limits(max_connections=N_CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        tasks = [stream_one(client, p, n) for p, n in zip(prompts, lengths, strict=True)]
        return await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)


def test_32_concurrent_streams_equal_the_offline_engine(served):
    prompts = [f"Client {i} says hello" + "!" * (i % 5) for i in range(N_CLIENTS)]
    lengths = [4 + (7 * i) % 20 for i in range(N_CLIENTS)]  # mixed lengths: requests leave at different steps
    results = asyncio.run(run_clients(served.url, prompts, lengths))
    for prompt, n, (text, pieces) in zip(prompts, lengths, results, strict=True):
        ids = served.tokenizer.encode(prompt)
        expected = served.tokenizer.decode(offline_greedy(served.model, [ids], n)[0])
        assert text == expected, prompt
        assert sum(len(p) for p in pieces) == n  # one character per token: nothing lost, nothing twice
    state = served.wait_idle()
    assert state["stats"]["requests_finished"] == N_CLIENTS
    assert state["stats"]["peak_blocks_in_use"] > 0 and state["blocks_in_use"] == 0
