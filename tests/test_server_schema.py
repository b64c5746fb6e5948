"""The OpenAPI schema tells the truth, checked by a tool nobody here wrote: schemathesis generates
requests from /openapi.json (valid ones and invalid ones) and checks every answer against the schema
(status code documented, content type documented, body matches its model, no 5xx, invalid data
refused, Allow on 405, headers...). Plus the few facts it does not look at, checked by hand.

Each run draws a fresh seed (printed, to rerun a failure with `--seed`). The schema's example requests
include a streamed one per generation route, so every run checks real text/event-stream answers against
the schema's event shape; the HAR report proves they were sent and answered 200.

One check is left out, `positive_data_acceptance` ("every schema-valid request gets 2xx"): a few
rules span several fields and JSON Schema cannot say them, so some schema-valid requests are rightly
400s: prompt length + max_tokens must fit the context and the KV pool; max_tokens=0 needs echo=true;
min_tokens <= max_tokens; top_logprobs needs logprobs=true; prompts x n within the server's capacity.
Each of those 400s names its parameter (test_server.py checks them one by one).
"""

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_support import make_char_checkpoint, running_server

from mini_transformer.engine import EngineConfig

MODEL = "tiny"
MAX_EXAMPLES = 25  # per operation and phase: ~1,000 requests
SCHEMATHESIS_TIMEOUT_S = 540  # a bound, not an expectation


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-char")
    make_char_checkpoint(path, max_seq_len=64)
    with running_server(path, config=EngineConfig(block_size=4, num_blocks=128, max_num_seqs=8), model_name=MODEL,
                        max_waiting=32) as server:
        yield server


def schemathesis_command() -> list[str]:
    found = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert found, "schemathesis is a dev dependency: uv sync"
    return [found]


def test_schemathesis_finds_nothing(served, tmp_path):
    seed = random.randrange(2**31)
    print(f"schemathesis --seed {seed}")
    cmd = [*schemathesis_command(), "run", served.url + "/openapi.json", "--checks", "all",
           "--exclude-checks", "positive_data_acceptance", "--max-examples", str(MAX_EXAMPLES), "--seed", str(seed),
           "--workers", "1", "--request-timeout", "60", "--continue-on-failure", "--report-dir", str(tmp_path),
           "--generation-database", "none", "--report", "har"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=SCHEMATHESIS_TIMEOUT_S, cwd=tmp_path)
    assert done.returncode == 0, f"seed {seed}\n" + done.stdout[-6000:] + done.stderr[-2000:]
    assert "Tested: 11" in done.stdout and "No issues found" in done.stdout, done.stdout[-3000:]
    streamed = [entry for entry in _har_entries(tmp_path) if _streams(entry["request"])]
    assert streamed, "no stream: true request was generated"
    assert any(e["response"]["status"] == 200 and e["response"]["content"]["mimeType"].startswith(
        "text/event-stream") for e in streamed), "no streamed 200 answer was checked against the schema"
    served.wait_idle()


def _har_entries(report_dir: Path) -> list[dict]:
    (har,) = report_dir.glob("har-*.json")
    return json.loads(har.read_text())["log"]["entries"]


def _streams(request: dict) -> bool:
    try:
        body = json.loads(request.get("postData", {}).get("text", ""))
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("stream") is True


def test_every_operation_documents_its_answers(served):
    schema = httpx.get(served.url + "/openapi.json", timeout=30).json()
    paths = schema["paths"]
    assert "/v1/engine/state" in paths and "parameters" not in paths["/v1/engine/state"]["get"]  # no ?stream
    for path, operations in paths.items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            assert responses["200"]["content"], (method, path)
            for status, response in responses.items():
                if status.startswith(("4", "5")) and path != "/health":
                    assert response["content"]["application/json"]["schema"] == {
                        "$ref": "#/components/schemas/ErrorBody"}, (method, path, status)
    completions = paths["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "429", "500", "503"} <= set(completions)
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert completions["200"]["content"]["text/event-stream"]["schema"]["required"] == ["data"]  # one event
    assert "Retry-After" in completions["429"]["headers"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == [
        httpx.get(served.url + "/metrics", timeout=30).headers["content-type"]]
    request = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["model"]["enum"] == [MODEL]
    assert request["max_tokens"]["anyOf"][0]["maximum"] == 64  # max_model_len
    vocab = served.ctx.vocab_size
    assert request["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == vocab - 1


def test_405_names_the_allowed_methods(served):
    response = httpx.delete(served.url + "/v1/completions", timeout=30)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.get(served.url + "/v2/nothing", timeout=30)
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
