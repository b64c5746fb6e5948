"""Structured output through the server (server/structured.py), spoken to by the official openai client.

Reference: the same prompt and constraint through an offline LLMEngine given the same tokenizer (greedy):
the same text and finish_reason. A random-weight model over a byte-level BPE vocabulary (JSON needs
braces and quotes, which a character vocabulary from plain text lacks) on a free port of 127.0.0.1.
"""

import json

import httpx
import jsonschema
import openai
import pytest
import torch
from server_support import running_server

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM
from mini_transformer.engine import EngineConfig, LLMEngine
from mini_transformer.inference.structured import StructuredOutput
from mini_transformer.tokenizer import BPETokenizer

MODEL = "tiny-bpe"
TEXT = ('{"name": "alice", "age": 31, "ok": true, "tags": ["a", "b"]} [1, 2, 3] null false -7 '
        "the quick brown fox jumps over the lazy dog yes no maybe ") * 10
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
          "required": ["id", "tag", "ok"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bpe")
    tokenizer = BPETokenizer.train(TEXT, 320)
    cfg = TransformerConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, n_layer=2, d_ff=64,
                            max_seq_len=256, init_std=0.2)
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    model.save_pretrained(path)
    tokenizer.save(path)
    with running_server(path, config=EngineConfig(block_size=4, num_blocks=512, max_num_seqs=8),
                        model_name=MODEL) as server:
        server.model, server.tokenizer = model, tokenizer
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        server.http = httpx.Client(base_url=server.url, timeout=60)
        yield server
        server.http.close()


def offline(served, prompt: str, structured: StructuredOutput, max_tokens: int) -> tuple[str, str]:
    """(text, finish_reason) from an offline engine: greedy, the same tokenizer and EOS."""
    tok = served.tokenizer
    engine = LLMEngine(served.model, EngineConfig(block_size=4, num_blocks=256), eos_token_id=tok.eos_token_id,
                       tokenizer=tok)
    engine.add_request(tok.encode(prompt), SamplingParams(max_tokens=max_tokens, structured=structured))
    ids, reason = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
            reason = out.finish_reason
    if reason == "stop":
        ids = ids[:-1]  # EOS is not text
    return tok.decode(ids), reason


def test_openai_client_response_format_json_schema_on_completions(served):
    response_format = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    out = served.client.completions.create(model=MODEL, prompt="the quick", max_tokens=60, temperature=0,
                                           extra_body={"response_format": response_format})
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == offline(served, "the quick", StructuredOutput(json_schema=SCHEMA), 60)
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_openai_client_response_format_on_chat(served):
    messages = [{"role": "user", "content": "an item please"}]
    response_format = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    out = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                                response_format=response_format)
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    sampled = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=1,
                                                    seed=3, n=3, response_format={"type": "json_object"})
    for choice in sampled.choices:
        assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("extra, structured, check", [
    ({"guided_choice": ["yes", "no", "maybe"]}, StructuredOutput(choice=("yes", "no", "maybe")),
     lambda text: text in ("yes", "no", "maybe")),
    ({"guided_regex": r"[a-c]{2,4}-\d{2}"}, StructuredOutput(regex=r"[a-c]{2,4}-\d{2}"),
     lambda text: len(text) in (5, 6, 7) and text[-3] == "-"),
    ({"guided_json": SCHEMA}, StructuredOutput(json_schema=SCHEMA),
     lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
])
def test_vllm_guided_fields(served, extra, structured, check):
    out = served.client.completions.create(model=MODEL, prompt="pick", max_tokens=40, temperature=0, extra_body=extra)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == offline(served, "pick", structured, 40)
    assert choice.finish_reason == "stop" and check(choice.text)


def test_max_tokens_before_the_grammar_ends_is_length(served):
    out = served.client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0,
                                           extra_body={"guided_json": SCHEMA})
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text.startswith("{")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_constraints_are_a_400_naming_the_field(served, body, param):
    for path, request in (("/v1/completions", {"prompt": "x"}),
                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        response = served.http.post(path, json={"model": MODEL, "max_tokens": 5, **request, **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    with pytest.raises(openai.BadRequestError):
        served.client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body=body)
