"""The OpenAI-compatible server, spoken to by the official `openai` client and by raw httpx.

Reference: the same prompts through an offline LLMEngine (greedy), and the plain chat template by hand.
One server (tiny random model, char tokenizer) on a free port of 127.0.0.1 serves the whole module.
"""

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_support import make_char_checkpoint, offline_greedy, running_server, slowed_engine

from mini_transformer.engine import EngineConfig
from mini_transformer.tokenizer import CHAT_TEMPLATE

MODEL = "tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-char")
    model, tokenizer = make_char_checkpoint(path, max_seq_len=384)
    with running_server(path, config=EngineConfig(block_size=4, num_blocks=512, max_num_seqs=8),
                        model_name=MODEL) as server:
        server.model, server.tokenizer = model, tokenizer
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
        server.http = httpx.Client(base_url=server.url, timeout=30)
        yield server
        server.http.close()


def reference(served, prompts: list[str], max_tokens: int) -> list[str]:
    ids = [served.tokenizer.encode(p) for p in prompts]
    return [served.tokenizer.decode(out) for out in offline_greedy(served.model, ids, max_tokens)]


def test_models(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completions_equal_the_offline_engine(served):
    prompts = ["Hello there", "The quick brown fox", "a"]
    expected = reference(served, prompts, 12)
    out = served.client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected
    assert all(c.finish_reason == "length" for c in out.choices)
    prompt_tokens = sum(len(p) for p in prompts)  # one token per character
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 36)
    assert out.usage.total_tokens == prompt_tokens + 36

    for prompt, text in zip(prompts, expected, strict=True):
        stream = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                  stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == text
        assert chunks[-1].choices[0].finish_reason == "length"


def test_token_id_prompts(served):
    ids = [served.tokenizer.encode("Good day"), served.tokenizer.encode("Sir")]
    expected = [served.tokenizer.decode(o) for o in offline_greedy(served.model, ids, 6)]
    one = served.client.completions.create(model=MODEL, prompt=ids[0], max_tokens=6, temperature=0)
    both = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert one.choices[0].text == expected[0]
    assert [c.text for c in both.choices] == expected


def test_chat_equals_the_offline_engine_through_the_plain_template(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = "System: Be brief.\nUser: Hi there\nAssistant:"  # CHAT_TEMPLATE written out
    assert "Assistant:" in CHAT_TEMPLATE
    expected = reference(served, [prompt], 10)[0]
    out = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 10)

    stream = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_n2_with_a_seed_is_reproducible_and_shares_the_prompt_blocks(served):
    prompt = "Sampling twice from one prompt"  # 30 tokens: 7 full blocks of 4
    stats = served.ctx.engine_loop.engine.stats
    hits_before = stats()["prefix_cache_hit_tokens"]
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=7)
    first = served.client.completions.create(n=2, **kwargs)
    assert stats()["prefix_cache_hit_tokens"] - hits_before >= 28  # the second choice reused 7 blocks
    again = served.client.completions.create(n=2, **kwargs)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert texts[0] != texts[1]  # different seeds per choice (equal by chance: ~V**-16)
    # choice j draws with seed + j: the same as a lone request with that seed
    for j in range(2):
        alone = served.client.completions.create(**{**kwargs, "seed": 7 + j})
        assert alone.choices[0].text == texts[j]
    assert first.usage.completion_tokens == 32 and first.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(served, stream):
    full = reference(served, ["Where is the stop"], 20)[0]
    stop = full[6:8]
    cut = full[:full.index(stop)]
    out = served.client.completions.create(model=MODEL, prompt="Where is the stop", max_tokens=20, temperature=0,
                                           stop=[stop], stream=stream)
    if stream:
        chunks = list(out)
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, finish = out.choices[0].text, out.choices[0].finish_reason
    assert (text, finish) == (cut, "stop")
    served.wait_idle()


def sse_events(raw: bytes) -> list[str]:
    """Split an SSE body; every event must be exactly one `data: ` line followed by a blank line."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [e[len("data: "):] for e in events]


def test_raw_sse_framing(served):
    body = {"model": MODEL, "prompt": "Raw bytes", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with served.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == reference(served, ["Raw bytes"], 5)[0]


def test_engine_state_json_and_stream(served):
    state = served.http.get("/v1/engine/state").json()
    assert state["num_blocks"] == 512 and state["block_size"] == 4
    assert len(state["pool"]["ref_count"]) == 512 and len(state["pool"]["cached"]) == 512
    assert state["running"] == [] and state["waiting"] == []
    assert "pool" in served.http.get("/v1/engine/state", params={"stream": "true"}, timeout=5).json()  # no Accept
    with served.http.stream("GET", "/v1/engine/state", headers={"Accept": "text/event-stream"}) as response:
        lines = response.iter_lines()
        events = []
        for line in lines:  # bounded: two events, then the client leaves
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    break
    assert all("pool" in e and "tokens_per_s" in e for e in events)


BAD_REQUESTS = [  # (path, body or raw bytes, expected param)
    ("/v1/completions", b'{"model": "tiny", "prompt": ', None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 380, "max_tokens": 10}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "not in the vocabulary: é"}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 9999]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [9999]}, "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0, "echo": False}, "max_tokens"),
    # known parameters this server cannot honour: refused by name, never ignored
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "end"}, "suffix"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
    # supported (server/structured.py), but this character vocabulary has no "{" to begin a JSON object
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, "top_logprobs"),
    # bounds: each where the engine (or torch's seed) has one
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 129}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["x"] * 65}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"999": 1}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"1": 101}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": ["hi"] * 10, "n": 128}, "n"),  # never fits: 400, not 429
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, None),
]


@pytest.mark.parametrize("path, body, param", BAD_REQUESTS)
def test_bad_requests_get_400_and_the_next_good_one_succeeds(served, path, body, param):
    if isinstance(body, bytes):
        response = served.http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = served.http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    good = served.client.completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0)
    assert good.choices[0].finish_reason == "length"


def metric(served, name: str) -> float:
    for line in served.http.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_disconnect_mid_stream_aborts_and_frees_the_blocks(served):
    aborted = metric(served, f'vllm:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}')
    body = {"model": MODEL, "prompt": "Leave early", "max_tokens": 360, "temperature": 0, "stream": True}
    # slowed: the request must still run when the client leaves (unslowed it lasts ~0.3 s on an idle machine)
    with slowed_engine(served), httpx.Client(base_url=served.url, timeout=30) as client, \
            client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()  # held: dropping a half-read iterator closes the connection
        next(line for line in lines if line.startswith("data: "))  # the first token came
        deadline = time.monotonic() + 60  # the gauges refresh every STATE_INTERVAL_S while busy
        while metric(served, "mini_transformer_kv_blocks_in_use") == 0:
            assert time.monotonic() < deadline, "no blocks in use while the request runs"
            time.sleep(0.02)
    # leaving the `with` closed the connection mid-stream
    deadline = time.monotonic() + 60
    while metric(served, "mini_transformer_kv_blocks_in_use") > 0:
        assert time.monotonic() < deadline, "blocks still held after the client left"
        time.sleep(0.05)
    assert metric(served, f'vllm:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}') == aborted + 1
    assert served.ctx.engine_loop.engine.stats()["requests_aborted"] >= 1


def test_get_load_counts_the_requests_in_flight(served):
    """vllm-router's load-aware policies poll GET /get_load for {"load": N} (open, like /health)."""
    assert served.http.get("/get_load").json() == {"load": 0}
    body = {"model": MODEL, "prompt": "Keep me busy", "max_tokens": 360, "temperature": 0, "stream": True}
    with slowed_engine(served), httpx.Client(base_url=served.url, timeout=30) as client, \
            client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # running now
        assert served.http.get("/get_load").json() == {"load": 1}
    served.wait_idle()
    assert served.http.get("/get_load").json() == {"load": 0}


def test_metrics_export_the_histograms_and_counters(served):
    served.client.completions.create(model=MODEL, prompt="count me", max_tokens=4, temperature=0)
    text = served.http.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "mini_transformer_kv_blocks_in_use", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:time_per_output_token_seconds_count", "vllm:generation_tokens_total",
                 "vllm:num_preemptions_total"):  # a count that only grows: a counter, named _total
        assert name in text
    assert "# TYPE vllm:num_preemptions_total counter" in text
    assert metric(served, "vllm:generation_tokens_total") >= 4
    assert served.http.get("/health").json() == {"status": "ok"}


def test_api_key_401(tmp_path):
    make_char_checkpoint(tmp_path, max_seq_len=64)
    with running_server(tmp_path, config=EngineConfig(num_blocks=64, block_size=4), model_name=MODEL,
                        api_key="secret") as server:
        for key in ("wrong",):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=30)
            with pytest.raises(openai.AuthenticationError) as err:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        missing = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
        assert missing.status_code == 401 and missing.json()["error"]["message"].startswith("missing")
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="secret", max_retries=0, timeout=30)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0).choices


def test_too_many_waiting_429(tmp_path):
    make_char_checkpoint(tmp_path, max_seq_len=384)
    with running_server(tmp_path, config=EngineConfig(num_blocks=256, block_size=4, max_num_seqs=1), model_name=MODEL,
                        max_waiting=0) as server, slowed_engine(server):  # the long one must still run
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
        body = {"model": MODEL, "prompt": "Long one", "max_tokens": 370, "temperature": 0, "stream": True}
        with httpx.Client(base_url=server.url, timeout=30) as http, http.stream("POST", "/v1/completions",
                                                                                json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it is running
            with pytest.raises(openai.RateLimitError) as err:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert err.value.status_code == 429 and "waiting" in err.value.body["message"]
        server.wait_idle()
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0).choices


def test_stop_token_ends_the_choice_and_is_not_in_the_text(served):
    ids = served.tokenizer.encode("Stop on a token")
    full = offline_greedy(served.model, [ids], 12)[0]
    stop_id = full[5]
    k = full.index(stop_id)
    out = served.client.completions.create(model=MODEL, prompt="Stop on a token", max_tokens=12, temperature=0,
                                           extra_body={"stop_token_ids": [stop_id]})
    assert out.choices[0].text == served.tokenizer.decode(full[:k])
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == k + 1


def test_serves_a_hugging_face_gpt2_directory_with_its_chat_template(tmp_path):
    """A local HF GPT-2 directory: weights imported, tokenizer.json used, the chat template rendered as
    transformers renders it; the answer equals the offline engine on the same imported model."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from mini_transformer import TransformerLM
    from mini_transformer.tokenizer import BPETokenizer

    tokenizer = BPETokenizer.train("the quick brown fox jumps over the lazy dog. " * 20, vocab_size=300)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                        initializer_range=0.3)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    tokenizer.save(tmp_path)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": "<|endoftext|>"}))
    messages = [{"role": "user", "content": "the quick fox"}]
    rendered = PreTrainedTokenizerFast.from_pretrained(str(tmp_path)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(rendered)
    model = TransformerLM.from_pretrained(tmp_path)
    engine_out = offline_greedy(model, [prompt_ids], 8)[0]
    eos = tokenizer.eos_token_id
    expected = engine_out[:engine_out.index(eos)] if eos in engine_out else engine_out
    with running_server(tmp_path, config=EngineConfig(num_blocks=64, block_size=4), model_name="gpt2-tiny") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
        out = client.chat.completions.create(model="gpt2-tiny", messages=messages, max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.choices[0].message.content == tokenizer.decode(expected)


def failing_once(real, when=lambda: True):
    """`real`, except that the first call made while `when()` holds raises RuntimeError("injected")."""
    failed = []

    def wrapper(*args, **kwargs):
        if not failed and when():
            failed.append(1)
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("where", ["engine.add_checked_request", "_publish_state"])
def test_an_error_in_a_loop_turn_fails_the_request_with_500_and_the_loop_goes_on(served, monkeypatch, where):
    loop = served.ctx.engine_loop
    owner, name = (loop.engine, "add_checked_request") if where.startswith("engine.") else (loop, where)
    # _publish_state also runs while idle: fail it only once a request is in flight
    monkeypatch.setattr(owner, name, failing_once(getattr(owner, name), when=lambda: bool(loop._active)
                                                  or owner is loop.engine))
    response = served.http.post("/v1/completions", json={"model": MODEL, "prompt": "boom", "max_tokens": 4})
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "injected" in error["message"]
    assert loop.alive and served.http.get("/health").status_code == 200
    served.wait_idle()
    good = served.client.completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0)
    assert good.choices[0].finish_reason == "length"


def test_health_is_503_and_requests_are_refused_once_the_engine_thread_is_gone(tmp_path):
    make_char_checkpoint(tmp_path, max_seq_len=64)
    with running_server(tmp_path, config=EngineConfig(num_blocks=64, block_size=4), model_name=MODEL) as server:
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        server.ctx.engine_loop.shutdown(timeout=10)  # the thread ends while the HTTP side still serves
        assert not server.ctx.engine_loop.alive
        health = httpx.get(server.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json() == {"status": "engine thread not running"}
        refused = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"


def test_an_eos_token_with_id_0_ends_the_choice(tmp_path):
    """tokenizer_config.json names "\\n" (id 0 of the char vocabulary) as EOS. The model is relabelled
    (token ids 0 and t swapped, t a token it greedily emits) so that it emits id 0; the server must stop
    there, exactly where the offline engine given eos_token_id=0 stops."""
    import torch

    from mini_transformer import SamplingParams, TransformerLM
    from mini_transformer.engine import EngineConfig, LLMEngine

    model, tokenizer = make_char_checkpoint(tmp_path, max_seq_len=64)
    assert tokenizer.encode("\n") == [0]
    prompt = tokenizer.encode("Hello there")
    t = next(x for x in offline_greedy(model, [prompt], 12)[0][1:] if x != 0)
    swap = {0: t, t: 0}
    with torch.no_grad():
        for weight in {id(w): w for w in (model.tok_emb.weight, model.lm_head.weight)}.values():
            weight[[0, t]] = weight[[t, 0]]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "\n"}))
    (tmp_path / "generation_config.json").unlink()  # which says a character checkpoint stops at no token
    model.save_pretrained(tmp_path)  # its manifest covers the changed tokenizer_config.json
    prompt = [swap.get(x, x) for x in prompt]
    model = TransformerLM.from_pretrained(tmp_path)
    full = offline_greedy(model, [prompt], 12)[0]
    k = full.index(0)
    expected = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64), eos_token_id=0).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert k < 11 and expected == full[:k + 1]
    with running_server(tmp_path, config=EngineConfig(num_blocks=64, block_size=4), model_name=MODEL) as server:
        assert server.ctx.engine_loop.engine.eos_token_id == 0
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == k + 1
    assert out.choices[0].text == tokenizer.decode(full[:k])


def test_the_server_admits_exactly_what_the_engine_admits(tmp_path):
    """One door rule, the engine's: a pool of 8 blocks of 4 holds 32 tokens, and a request of 33 fits
    (its last token is sampled, never cached); 34 does not, and the 400 carries the engine's message."""
    from mini_transformer import SamplingParams

    make_char_checkpoint(tmp_path, max_seq_len=64)
    prompt = "ten chars!"
    with running_server(tmp_path, config=EngineConfig(num_blocks=8, block_size=4), model_name=MODEL) as server:
        engine = server.ctx.engine_loop.engine
        ids = server.ctx.codec.encode(prompt)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=33 - len(ids), temperature=0)
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 33 - len(ids)
        with pytest.raises(ValueError) as engine_error:
            engine.check_request(ids, SamplingParams(max_tokens=34 - len(ids)))
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=34 - len(ids), temperature=0)
        assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "prompt"
        assert str(engine_error.value) in err.value.body["message"]
        server.wait_idle()


def test_warm_up_leaves_the_engine_empty_and_its_greedy_tokens_unchanged(tmp_path):
    """serve's warm-up (dummy requests before the server is ready) must leave no request, no block in use
    and no trace in what the engine generates afterwards: the reference is an offline engine never warmed."""
    from mini_transformer import SamplingParams
    from mini_transformer.server import build_context

    model, tokenizer = make_char_checkpoint(tmp_path)
    engine = build_context(tmp_path, config=EngineConfig(block_size=4), warm_up=True).engine_loop.engine
    assert not engine.has_unfinished_requests()
    assert engine.stats()["blocks_in_use"] == 0 and engine.stats()["steps"] > 0  # it did step
    prompts = [tokenizer.encode(text) for text in ("Hello there", "a", "The quick brown fox jumps")]
    got = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert got == offline_greedy(model, prompts, 8)


def test_every_series_of_vllms_dashboard_is_exported_with_model_name(served):
    """vLLM's own Grafana dashboard (tests/data/) reads this server: each series it queries is here."""
    dashboard = json.loads((Path(__file__).parent / "data" / "vllm_grafana_dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"vllm:[A-Za-z0-9_:]+", expr)}
    assert len(queried) >= 17
    served.client.completions.create(model=MODEL, prompt="for the dashboard", max_tokens=3, temperature=0)
    lines = served.http.get("/metrics").text.splitlines()
    for name in sorted(queried):
        found = [line for line in lines if line.startswith(name + "{")]
        assert found, f"{name} not in /metrics"
        assert all(f'model_name="{MODEL}"' in line for line in found), found[:2]
    assert metric(served, f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}') >= 1
    assert 0.0 <= metric(served, "vllm:kv_cache_usage_perc") <= 1.0


def test_non_streamed_requests_are_aborted_when_their_client_leaves(served):
    """n > 1, tokens flowing: the client that left is noticed anyway, and all its choices aborted."""
    aborted = metric(served, f'vllm:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}')
    body = {"model": MODEL, "prompt": "Walk away", "max_tokens": 300, "n": 4, "temperature": 1.0, "seed": 3,
            "ignore_eos": True}
    with slowed_engine(served):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while its choices still decode
            httpx.post(served.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.4))
        left = time.monotonic()
        deadline = left + 30  # a bound on a loaded machine; unloaded it takes one disconnect poll
        # the request may still be on its way in (tokenised on a worker) when the client leaves: wait for
        # its four aborts, not only for an idle engine
        while served.ctx.engine_loop.engine.has_unfinished_requests() or metric(
                served, f'vllm:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}') < aborted + 4:
            assert time.monotonic() < deadline, "the engine still runs the request of a client that left"
            time.sleep(0.02)
    assert metric(served, f'vllm:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}') \
        == aborted + 4
