"""Each parameter a real client sends, through the official `openai` client, against a direct
computation with the model: log-probabilities == log_softmax of one forward pass (the raw model
distribution, vLLM's convention), logit_bias and the penalties change the logits exactly as defined
(a greedy loop over plain forward passes with the same change picks the same tokens), echo returns the
prompt, and the tokenizer endpoints and files agree with our tokenizer.

One server (tiny random model, char tokenizer) on a free port of 127.0.0.1 serves the module.
"""

import math

import httpx
import openai
import pytest
import torch
from server_support import make_char_checkpoint, offline_greedy, running_server

from mini_transformer.engine import EngineConfig

MODEL = "tiny"
TOL = 1e-4  # float32 logits, paged attention vs one plain forward pass


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-char")
    model, tokenizer = make_char_checkpoint(path, max_seq_len=128)
    with running_server(path, config=EngineConfig(block_size=4, num_blocks=256, max_num_seqs=8),
                        model_name=MODEL) as server:
        server.model, server.tokenizer, server.path = model, tokenizer, path
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        server.http = httpx.Client(base_url=server.url, timeout=60)
        yield server
        server.http.close()


@torch.no_grad()
def log_probs(model, ids: list[int]) -> torch.Tensor:
    """(T, V) log_softmax of one forward pass over ids: row i predicts token i + 1."""
    logits, _ = model(torch.tensor([ids]))
    return torch.log_softmax(logits[0].double(), dim=-1)


@torch.no_grad()
def greedy_with(model, prompt: list[int], steps: int, change=lambda logits, out: logits, stops=()) -> list[int]:
    """The reference loop: a full forward pass per token, `change(logits, generated so far)`, argmax."""
    ids, out = list(prompt), []
    for _ in range(steps):
        logits, _ = model(torch.tensor([ids]))
        token = int(change(logits[0, -1].float().clone(), out).argmax())
        out.append(token)
        ids.append(token)
        if token in stops:
            break
    return out


# ------------------------------------------------------------------------------------- logprobs
def test_echo_prompt_logprobs_are_log_softmax_of_one_forward(served):
    """What lm-eval's loglikelihood sends: token ids, echo, logprobs, max_tokens 0 (and 1)."""
    tok = served.tokenizer
    prompt = tok.encode("The cat sat on the mat")
    reference = log_probs(served.model, prompt)
    out = served.client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=3, max_tokens=0)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text == tok.decode(prompt) and out.usage.completion_tokens == 0
    assert lp.tokens == [tok.decode([t]) for t in prompt]
    assert lp.text_offset == list(range(len(prompt)))  # one character per token
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert math.isclose(lp.token_logprobs[i], reference[i - 1, prompt[i]], abs_tol=TOL)
        top = torch.topk(reference[i - 1], 3)
        expected = {tok.decode([int(t)]): float(v) for v, t in zip(top.values, top.indices, strict=True)}
        expected.setdefault(lp.tokens[i], float(reference[i - 1, prompt[i]]))  # the chosen one is always there
        assert lp.top_logprobs[i].keys() == expected.keys()
        assert all(math.isclose(lp.top_logprobs[i][k], v, abs_tol=TOL) for k, v in expected.items())

    # lm-eval's exact request: max_tokens 1, logprobs 1; the prompt's part is the same, one token follows
    scored = served.client.completions.create(model=MODEL, prompt=[prompt], echo=True, logprobs=1, max_tokens=1,
                                              temperature=0)
    lp1 = scored.choices[0].logprobs
    assert len(lp1.token_logprobs) == len(prompt) + 1
    assert all(math.isclose(a, b, abs_tol=TOL) for a, b in zip(lp1.token_logprobs[1:-1], lp.token_logprobs[1:],
                                                              strict=True))
    assert scored.choices[0].text.startswith(tok.decode(prompt))


def test_prompt_logprobs_in_vllms_format(served):
    """vLLM's prompt_logprobs=N: per prompt token (the first: null) {token id: {logprob, rank, decoded_token}}
    for the N most likely and the prompt token itself, == log_softmax of one forward; beside echo's logprobs=1,
    whose top dicts keep their own N."""
    tok = served.tokenizer
    prompt = tok.encode("The cat sat")
    reference = log_probs(served.model, prompt)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "echo": True, "logprobs": 1}
    choice = served.http.post("/v1/completions", json=body).json()["choices"][0]
    got = choice["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        top = torch.topk(reference[i - 1], 2)
        for rank, (value, token) in enumerate(zip(top.values, top.indices, strict=True), start=1):
            entry = got[i][str(int(token))]
            assert entry["rank"] == rank and entry["decoded_token"] == tok.decode([int(token)])
            assert math.isclose(entry["logprob"], float(value), abs_tol=TOL)
        assert math.isclose(got[i][str(prompt[i])]["logprob"], reference[i - 1, prompt[i]], abs_tol=TOL)
        assert len(got[i]) in (2, 3) and len(choice["logprobs"]["top_logprobs"][i]) in (1, 2)
    plain = served.http.post("/v1/completions", json={"model": MODEL, "prompt": "The", "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    streamed = served.http.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_lm_eval_rolling_loglikelihood_request(served):
    """lm-eval's loglikelihood_rolling: its prefix token is the tokenizer files' BOS (AutoTokenizer's
    bos_token_id, inside the vocabulary), sent before the document's ids with echo, logprobs=1, max_tokens=1;
    the document's log-likelihood is the sum of token_logprobs[1:-1]."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(served.path))
    prefix = auto.bos_token_id
    assert prefix is not None and prefix < served.tokenizer.vocab_size
    doc = auto("The cat sat on the mat.")["input_ids"]
    body = {"model": MODEL, "prompt": [[prefix, *doc]], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    response = served.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"][1:-1]
    reference = log_probs(served.model, [prefix, *doc])
    want = sum(float(reference[i, token]) for i, token in enumerate(doc))
    assert len(logprobs) == len(doc) and math.isclose(sum(logprobs), want, abs_tol=TOL * len(doc))


def test_tokenizer_info_gives_what_lm_evals_remote_tokenizer_needs(served):
    """lm-eval's remote tokenizer reads bos_token and eos_token from /tokenizer_info, encodes each through
    /tokenize, and starts each rolling window with `bos_id or eos_id`: a character vocabulary's newline
    has id 0 (falsy), so EOS must be given too, the same newline. Generation still runs past newlines."""
    info = served.http.get("/tokenizer_info").json()
    bos_id, eos_id = (served.http.post("/tokenize", json={"prompt": info[name], "add_special_tokens": False})
                      .json()["tokens"][0] for name in ("bos_token", "eos_token"))
    assert bos_id == eos_id == served.tokenizer.token_to_id("\n") == 0  # "\n" sorts first in this vocabulary
    assert (bos_id or eos_id) is not None
    assert served.ctx.codec.eos_token_id is None


@pytest.mark.parametrize("stream", [False, True])
def test_generated_logprobs_and_top_alternatives(served, stream):
    tok = served.tokenizer
    prompt = tok.encode("Once upon a time")
    expected_ids = offline_greedy(served.model, [prompt], 6)[0]
    out = served.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                           logprobs=2, stream=stream)
    if stream:  # each chunk carries the logprobs of its own tokens; text_offset runs on across chunks
        chunks = [c.choices[0] for c in out]
        text = "".join(c.text for c in chunks)
        parts = [c.logprobs for c in chunks if c.logprobs is not None]
        tokens = [t for p in parts for t in p.tokens]
        token_logprobs = [x for p in parts for x in p.token_logprobs]
        tops = [x for p in parts for x in p.top_logprobs]
        offsets = [x for p in parts for x in p.text_offset]
    else:
        lp = out.choices[0].logprobs
        text, tokens, token_logprobs, tops, offsets = (out.choices[0].text, lp.tokens, lp.token_logprobs,
                                                       lp.top_logprobs, lp.text_offset)
    assert text == tok.decode(expected_ids) and "".join(tokens) == text
    assert offsets == list(range(6))
    for k, token in enumerate(expected_ids):
        row = log_probs(served.model, prompt + expected_ids[:k])[-1]
        assert math.isclose(token_logprobs[k], row[token], abs_tol=TOL)
        top = torch.topk(row, 2)
        assert set(tops[k]) == {tok.decode([int(t)]) for t in top.indices}  # greedy: the chosen one is the top
        assert math.isclose(max(tops[k].values()), token_logprobs[k], abs_tol=TOL)


def test_chat_logprobs_and_top_logprobs(served):
    tok = served.tokenizer
    messages = [{"role": "user", "content": "Hi there"}]
    prompt = tok.encode("User: Hi there\nAssistant:")
    expected_ids = offline_greedy(served.model, [prompt], 5)[0]
    out = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in expected_ids]
    for k, item in enumerate(content):
        row = log_probs(served.model, prompt + expected_ids[:k])[-1]
        assert math.isclose(item.logprob, row[expected_ids[k]], abs_tol=TOL)
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 3
        assert [t.token for t in item.top_logprobs] == [tok.decode([int(i)]) for i in torch.topk(row, 3).indices]
    stream = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                   logprobs=True, stream=True)
    streamed = [x for c in stream if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.token for x in streamed] == [c.token for c in content]
    assert all(x.top_logprobs == [] for x in streamed)  # logprobs without top_logprobs: the chosen token only
    plain = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_without_logprobs_returns_the_prompt_then_the_text(served):
    tok = served.tokenizer
    expected = tok.decode(offline_greedy(served.model, [tok.encode("Echo me")], 4)[0])
    out = served.client.completions.create(model=MODEL, prompt="Echo me", echo=True, max_tokens=4, temperature=0)
    assert out.choices[0].text == "Echo me" + expected and out.choices[0].logprobs is None
    stream = served.client.completions.create(model=MODEL, prompt="Echo me", echo=True, max_tokens=4, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].text for c in stream) == "Echo me" + expected


# ------------------------------------------------------------------------- logits, as defined
def test_logit_bias_minus_100_bans_a_token_and_plus_100_forces_one(served):
    tok = served.tokenizer
    prompt = tok.encode("Ban the first")
    plain = offline_greedy(served.model, [prompt], 8)[0]
    banned = plain[0]

    def minus(logits, out):
        logits[banned] -= 100
        return logits

    reference = greedy_with(served.model, prompt, 8, minus)
    out = served.client.completions.create(model=MODEL, prompt="Ban the first", max_tokens=8, temperature=0,
                                           logit_bias={str(banned): -100})
    assert out.choices[0].text == tok.decode(reference) and banned not in reference
    forced = tok.encode("q")[0]
    out = served.client.completions.create(model=MODEL, prompt="Ban the first", max_tokens=5, temperature=0.8,
                                           seed=3, logit_bias={str(forced): 100})
    assert out.choices[0].text == "qqqqq"


def test_presence_and_frequency_penalties_change_logits_exactly_as_defined(served):
    """OpenAI's definition: logit[t] -= frequency * count[t] + presence * (count[t] > 0), count = how often t
    was generated so far. The logprobs stay those of the raw distribution."""
    tok = served.tokenizer
    prompt = tok.encode("aaaa bbbb aaaa")
    presence, frequency = 0.7, 1.5

    def penalised(logits, out):
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[-1]).float()
        return logits - frequency * counts - presence * (counts > 0).float()

    reference = greedy_with(served.model, prompt, 12, penalised)
    assert reference != greedy_with(served.model, prompt, 12)  # the penalties matter here
    out = served.client.completions.create(model=MODEL, prompt="aaaa bbbb aaaa", max_tokens=12, temperature=0,
                                           presence_penalty=presence, frequency_penalty=frequency, logprobs=0)
    assert out.choices[0].text == tok.decode(reference)
    for k, token in enumerate(reference):
        raw = log_probs(served.model, prompt + reference[:k])[-1, token]
        assert math.isclose(out.choices[0].logprobs.token_logprobs[k], raw, abs_tol=TOL)


def test_min_tokens_holds_back_the_stop_token_and_include_stop_str_keeps_it(served):
    tok = served.tokenizer
    prompt = tok.encode("Hold on")
    plain = offline_greedy(served.model, [prompt], 10)[0]
    stop = plain[0]

    def no_stop_before_3(logits, out):
        if len(out) < 3:
            logits[stop] = float("-inf")
        return logits

    reference = greedy_with(served.model, prompt, 10, no_stop_before_3, stops=(stop,))
    kwargs = dict(model=MODEL, prompt="Hold on", max_tokens=10, temperature=0, extra_body={
        "stop_token_ids": [stop], "min_tokens": 3})
    out = served.client.completions.create(**kwargs)
    assert out.usage.completion_tokens == len(reference) and len(reference) >= 3
    ends_on_stop = reference[-1] == stop
    assert out.choices[0].text == tok.decode(reference[:-1] if ends_on_stop else reference)
    kept = served.client.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"],
                                                                        "include_stop_str_in_output": True}})
    assert kept.choices[0].text == tok.decode(reference)


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_and_many_stop_strings(served, stream):
    tok = served.tokenizer
    full = tok.decode(offline_greedy(served.model, [tok.encode("Where is the stop")], 20)[0])
    stop = full[6:8]
    decoys = [f"#{i}#" for i in range(40)]  # more than OpenAI's 4; none occurs
    out = served.client.completions.create(model=MODEL, prompt="Where is the stop", max_tokens=20, temperature=0,
                                           stop=[*decoys, stop], stream=stream,
                                           extra_body={"include_stop_str_in_output": True})
    text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
    assert text == full[:full.index(stop) + len(stop)]


def test_n_128_choices(served):
    out = served.client.completions.create(model=MODEL, prompt="Many", max_tokens=2, temperature=1.0, n=128, seed=5)
    assert sorted(c.index for c in out.choices) == list(range(128))
    assert out.usage.completion_tokens == 256
    served.wait_idle()


# ------------------------------------------------------------------------- status semantics
def test_unknown_model_is_404_model_not_found(served):
    with pytest.raises(openai.NotFoundError) as err:
        served.client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_models_retrieve_gives_the_model_and_404_for_another_id(served):
    card = served.client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.model_extra["max_model_len"] == 128
    with pytest.raises(openai.NotFoundError) as err:
        served.client.models.retrieve("best")
    assert err.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("field, value", [("echo", True), ("prompt_logprobs", 1), ("prompt_logprobs", 0)])
def test_chat_refuses_echo_and_prompt_logprobs_rather_than_ignoring_them(served, field, value):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, field: value}
    response = served.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == field
    body[field] = None if field == "prompt_logprobs" else False  # asking for nothing is fine
    assert served.http.post("/v1/chat/completions", json=body).status_code == 200


def test_a_request_that_can_never_fit_is_400_not_429(served):
    capacity = served.ctx.engine_loop.capacity
    with pytest.raises(openai.BadRequestError) as err:
        served.client.completions.create(model=MODEL, prompt=["a"] * (capacity // 100 + 1), n=100, max_tokens=1)
    assert err.value.body["param"] == "n" and str(capacity) in err.value.body["message"]


def test_429_carries_retry_after(served, monkeypatch):
    loop = served.ctx.engine_loop
    monkeypatch.setattr(loop, "in_flight", loop.capacity)  # as if the server were full
    response = served.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "too_many_requests"


# ------------------------------------------------------------------------- tokenizer endpoints and files
def test_tokenize_detokenize_and_tokenizer_info(served):
    tok = served.tokenizer
    text = "Hello, world.\n"
    got = served.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                              "return_token_strs": True}).json()
    assert got["tokens"] == tok.encode(text) and got["count"] == len(text) and got["max_model_len"] == 128
    assert got["token_strs"] == list(text)
    chat = served.http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.json()["tokens"] == tok.encode("User: Hi\nAssistant:")
    assert served.http.post("/detokenize", json={"tokens": got["tokens"]}).json() == {"prompt": text}
    info = served.http.get("/tokenizer_info").json()
    assert info["vocab_size"] == tok.vocab_size and "eos_token" in info and info["chat_template"]
    bad = served.http.post("/detokenize", json={"tokens": [tok.vocab_size]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    unknown = served.http.post("/tokenize", json={"prompt": "é"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "prompt"
    assert served.http.post("/tokenize", json={"prompt": "a", "model": "x"}).status_code == 404


def test_autotokenizer_on_the_served_checkpoint_agrees_with_tokenize(served):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(served.path))
    text = "The quick brown fox.\nJumps!"
    remote = served.http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert auto(text)["input_ids"] == remote == served.tokenizer.encode(text)
    assert auto.decode(remote) == text


def test_a_tokenizer_of_another_size_is_refused_at_load(tmp_path):
    from mini_transformer.checkpoint import write_manifest
    from mini_transformer.server import build_context
    from mini_transformer.tokenizer import CharTokenizer

    model, tok = make_char_checkpoint(tmp_path, max_seq_len=32)
    for name in ("vocab.json", "tokenizer.json"):
        (tmp_path / name).unlink()
    CharTokenizer(tok.chars[:-2]).save(tmp_path)
    write_manifest(tmp_path)
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=f"{vocab - 2} tokens but the model's vocab_size is {vocab}"):
        build_context(tmp_path)
