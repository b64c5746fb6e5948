"""Who may use the server (server/access.py, and the serve command's flags in server/run.py): a request
whose Host header is not one of the server's names gets 421 before any route runs (DNS rebinding); with
an api key, /metrics needs it like the /v1 routes while / and /health stay open; the key comes from
--api-key, --api-key-file or MINI_TRANSFORMER_API_KEY; binding beyond loopback without a key warns."""

from __future__ import annotations

import httpx
import pytest
from server_support import ServerThread, make_char_checkpoint

from mini_transformer.cli import main
from mini_transformer.engine import EngineConfig
from mini_transformer.server import build_context
from mini_transformer.server.access import allowed_hosts, host_name
from mini_transformer.server.run import API_KEY_ENV, api_key_from, exposure_warning

MODEL = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    make_char_checkpoint(path, max_seq_len=64)
    return path


def start(checkpoint, names=(), **options) -> ServerThread:
    ctx = build_context(checkpoint, config=EngineConfig(num_blocks=64, block_size=4), model_name=MODEL, **options)
    ctx.allowed_hosts = allowed_hosts("127.0.0.1", names)  # as serve() sets it for --allowed-hosts
    return ServerThread(ctx).start()


def test_a_forged_host_header_is_421_on_every_route(checkpoint):
    server = start(checkpoint, names=("llm.internal",))
    try:
        port = server.port
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for host in ("rebind.attacker.example", f"rebind.attacker.example:{port}", "127.0.0.1.attacker.example",
                         "", f"localhost.:{port}"):
                for method, path in (("GET", "/"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
                                     ("POST", "/v1/completions")):
                    answer = client.request(method, path, headers={"Host": host},
                                            json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
                    assert answer.status_code == 421, (host, path, answer.text)
                    assert answer.json()["error"]["code"] == "misdirected_request"
            documented = client.get("/openapi.json").json()["paths"]  # the schema says so, on every route
            for path, operations in documented.items():
                for method, operation in operations.items():
                    assert "421" in operation["responses"], (method, path)
            for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", "llm.internal",
                         f"llm.internal:{port}"):
                assert client.get("/health", headers={"Host": host}).status_code == 200, host
            done = client.post("/v1/completions", headers={"Host": f"localhost:{port}"},
                               json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0})
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
    finally:
        server.stop()


def test_allowed_hosts_are_the_loopback_names_the_bind_address_and_the_extra_names():
    assert host_name("[::1]:8000") == "[::1]" and host_name("Example.COM:80") == "example.com"
    assert allowed_hosts("127.0.0.1") == {"localhost", "127.0.0.1", "[::1]"}
    assert allowed_hosts("0.0.0.0", ["llm.example:8000"]) == {"localhost", "127.0.0.1", "[::1]", "llm.example"}
    assert allowed_hosts("::", ["fd00::5"]) == {"localhost", "127.0.0.1", "[::1]", "[fd00::5]"}
    assert "10.0.0.7" in allowed_hosts("10.0.0.7")


def test_with_a_key_metrics_need_it_and_the_page_and_health_stay_open(checkpoint):
    server = start(checkpoint, api_key="the-key")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.get("/metrics").status_code == 401
            assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
            metrics = client.get("/metrics", headers={"Authorization": "Bearer the-key"})
            assert metrics.status_code == 200 and "mini_transformer_" in metrics.text
            assert client.get("/").status_code == 200 and client.get("/health").status_code == 200
            assert client.get("/v1/engine/state").status_code == 401
            documented = client.get("/openapi.json").json()["paths"]
            assert "401" in documented["/metrics"]["get"]["responses"]  # the schema says it too
            assert "401" not in documented["/health"]["get"]["responses"]
    finally:
        server.stop()


def test_the_api_key_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key_from(None, None) is None
    key_file = tmp_path / "key"
    key_file.write_text("from-the-file\n")
    assert api_key_from(None, key_file) == "from-the-file"
    monkeypatch.setenv(API_KEY_ENV, "from-the-env")
    assert api_key_from(None, None) == "from-the-env"
    assert api_key_from("from-the-flag", None) == "from-the-flag" and api_key_from(None, key_file) == "from-the-file"
    with pytest.raises(ValueError, match="not both"):
        api_key_from("k", key_file)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        api_key_from(None, tmp_path / "empty")
    with pytest.raises(ValueError, match="cannot read it"):
        api_key_from(None, tmp_path / "absent")


def test_binding_beyond_loopback_without_a_key_warns():
    for host in ("0.0.0.0", "::", "10.0.0.7", "llm.example"):
        assert "without an api key" in exposure_warning(host, None)
        assert exposure_warning(host, "k") is None
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert exposure_warning(host, None) is None


def test_serve_takes_the_key_from_the_environment_and_warns_without_one(checkpoint, monkeypatch, capsys):
    """The serve command's wiring, with build_context and serve replaced: nothing is bound."""
    import mini_transformer.server as server

    seen = {}
    monkeypatch.setattr(server, "build_context", lambda *a, **kw: seen.update(kw) or type("C", (), {"model_name": "m"}))
    monkeypatch.setattr(server, "serve", lambda ctx, **kw: seen.update(kw))
    argv = ["serve", "--checkpoint", str(checkpoint), "--host", "0.0.0.0", "--allowed-hosts", "llm.example", "a.b"]
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    assert main(argv) in (0, None)
    assert seen["api_key"] == "env-key" and seen["host_names"] == ("llm.example", "a.b")
    assert "without an api key" not in capsys.readouterr().err
    monkeypatch.delenv(API_KEY_ENV)
    assert main(argv) in (0, None)
    assert seen["api_key"] is None and "without an api key" in capsys.readouterr().err
