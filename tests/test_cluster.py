"""`mini-transformer cluster`: two replicas behind vllm-router (kv_aware, fed by our KV events), started
as the command line does and stopped by SIGTERM. Through the router the answers equal a direct server's;
a prefix one replica alone holds (sent to it directly, its KV events observed) is routed to that replica;
after `kill -9` of a replica, every request still succeeds and the live replica's /metrics answers.
Skipped with a message where vllm-router is absent."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import msgpack
import pytest
import zmq
from server_support import make_char_checkpoint

from mini_transformer.cli.cluster_command import free_port, router_binary

START_TIMEOUT_S = 300.0  # bounds, not expectations: two servers and a router on a busy 2-core machine
STOP_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 60.0
EVENT_TIMEOUT_S = 30.0
BS = 4

try:
    router_binary()
except ValueError as err:
    pytest.skip(f"{err}: the cluster tests need it", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    make_char_checkpoint(tmp / "ckpt", max_seq_len=160)
    log = open(tmp / "cluster.log", "w+")
    cmd = [sys.executable, "-m", "mini_transformer.cli", "cluster", "--checkpoint", str(tmp / "ckpt"),
           "--replicas", "2", "--policy", "kv_aware", "--block-size", str(BS), "--port", str(free_port()),
           "--serve-arg=--no-warm-up", "--router-arg=--health-failure-threshold=1"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    replicas = []
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (router := re.search(r"^router: (\S+)", text := (tmp / "cluster.log").read_text(), re.M)) is None:
            assert proc.poll() is None, f"the cluster exited: {text[-3000:]}"
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(0.5)
        for url, pid, events in re.findall(r"^replica \d: (\S+) \(pid (\d+), kv events (\S+)\)", text, re.M):
            replicas.append({"url": url, "pid": int(pid), "events": events})
        assert len(replicas) == 2
        yield {"router": router.group(1), "replicas": replicas}
    finally:
        proc.send_signal(signal.SIGTERM)  # as Ctrl-C: the cluster stops its servers and the router
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = [r["pid"] for r in replicas if alive(r["pid"])]
        if left:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        assert proc.returncode == 0 and not left, (tmp / "cluster.log").read_text()[-3000:]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a child of the cluster that exited but was not reaped yet is a zombie: gone all the same
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1][0] != "Z"


def complete(url: str, prompt: str, max_tokens: int = 6, headers: dict | None = None) -> httpx.Response:
    body = {"model": "ckpt", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S, headers=headers)


def served(url: str) -> float:
    """Requests this replica has finished: its vllm:request_success_total, all reasons."""
    text = httpx.get(url + "/metrics", timeout=HTTP_TIMEOUT_S).text
    return sum(float(v) for v in re.findall(r'^vllm:request_success_total\{[^}]*\} (\S+)', text, re.M))


def test_answers_through_the_router_equal_a_direct_servers(cluster):
    router, direct = cluster["router"], cluster["replicas"][0]["url"]
    for prompt in ("Hello there", "The quick brown fox", "abc abc abc"):
        via, ref = complete(router, prompt), complete(direct, prompt)
        assert via.status_code == ref.status_code == 200
        assert via.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
    chat = {"model": "ckpt", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
    via, ref = (httpx.post(url + "/v1/chat/completions", json=chat, timeout=HTTP_TIMEOUT_S) for url in (router, direct))
    assert via.json()["choices"][0]["message"] == ref.json()["choices"][0]["message"]
    with httpx.stream("POST", router + "/v1/completions", timeout=HTTP_TIMEOUT_S,
                      json={"model": "ckpt", "prompt": "Hello there", "max_tokens": 6, "temperature": 0,
                            "stream": True}) as stream:
        pieces = [json.loads(line[6:])["choices"][0]["text"] for line in stream.iter_lines()
                  if line.startswith("data: {")]
    assert "".join(pieces) == complete(direct, "Hello there").json()["choices"][0]["text"]
    models = httpx.get(router + "/v1/models", timeout=HTTP_TIMEOUT_S).json()
    assert [m["id"] for m in models["data"]] == ["ckpt"]


def test_a_request_id_header_names_the_response(cluster):
    direct = cluster["replicas"][0]["url"]
    answer = complete(direct, "Hello", headers={"X-Request-Id": "trace-42"})
    assert answer.json()["id"] == "cmpl-trace-42" and answer.headers["x-request-id"] == "trace-42"


def observe_stored(endpoint: str, sub, tokens: list[int]) -> None:
    """Wait (bounded) until the replica publishing on `endpoint` says it stored `tokens`' first block."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while time.monotonic() < deadline:
        if not sub.poll(200):
            continue
        _, _, payload = sub.recv_multipart()
        for event in msgpack.unpackb(payload)[1]:
            if event["type"] == "BlockStored" and event["parent_block_hash"] is None \
                    and event["token_ids"][:BS] == tokens[:BS]:
                return
    raise AssertionError(f"no BlockStored for the prompt from {endpoint}")


def test_kv_aware_sends_a_prefix_to_the_replica_that_holds_it(cluster):
    router, replicas = cluster["router"], cluster["replicas"]
    prefixes = ["Once upon a time there was a tiny model.", "Quietly, seven zebras jumped over a fence!"]
    ctx = zmq.Context.instance()
    subs = []
    try:
        for replica in replicas:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(replica["events"])
            subs.append(sub)
        time.sleep(1.0)  # a SUB socket misses what is published before it has joined
        for replica, sub, prefix in zip(replicas, subs, prefixes, strict=True):  # each prefix to one replica only
            assert complete(replica["url"], prefix, max_tokens=1).status_code == 200
            tokens = httpx.post(replica["url"] + "/tokenize", json={"model": "ckpt", "prompt": prefix},
                                timeout=HTTP_TIMEOUT_S).json()["tokens"]
            observe_stored(replica["events"], sub, tokens)
    finally:
        for sub in subs:
            sub.close(linger=0)
    time.sleep(1.0)  # the router's own subscription receives the same batches
    # not alternating, so that round robin cannot pass by chance
    for owner, tail in ((0, " Then"), (0, " And"), (1, " Then"), (1, " And"), (0, " So"), (1, " So")):
        before = [served(r["url"]) for r in replicas]
        assert complete(router, prefixes[owner] + tail).status_code == 200
        grew = [served(r["url"]) - b for r, b in zip(replicas, before, strict=True)]
        assert grew[owner] == 1 and grew[1 - owner] == 0, (owner, tail, grew)


def test_a_killed_replica_is_routed_around(cluster):
    router, (live, dead) = cluster["router"], cluster["replicas"]
    os.kill(dead["pid"], signal.SIGKILL)
    before = served(live["url"])
    answers = [complete(router, f"Request {i} after the kill").status_code for i in range(10)]
    assert answers == [200] * 10
    assert served(live["url"]) - before == 10  # the live replica's /metrics answers, and counted them all
