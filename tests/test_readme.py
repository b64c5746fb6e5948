"""README.md runs as written: every shell and Python block, in order, then the "run" command of
each stage in docs/README.md, on a clean temporary directory, the way a new user copies them.

How each example is run, and the only things that differ from a user's shell:
- shell lines go to bash with the project's virtual environment NOT on PATH (a fresh shell): `uv run`
  finds the project through UV_PROJECT, so a line that only works inside an activated venv fails here too;
- offline: MINI_TRANSFORMER_OFFLINE=1 and an empty MINI_TRANSFORMER_CACHE (so `train` trains on the pydoc
  text that ships with Python, as it does on a machine without network), UV_OFFLINE=1; servers bind 127.0.0.1;
- short: MINI_TRANSFORMER_MAX_STEPS=20 caps every `train` at 20 steps (cli/train_command.py) and changes
  nothing else, so one short run serves every later example;
- `serve` starts in the background as written, except its port number: `--port 8000` becomes a free port
  (a `serve` line without --port gets `--port FREE`), and so does `:8000` in the examples after it. It is
  stopped with SIGTERM when a later `serve` takes its port, or at the end, and must then exit 0;
- Python blocks: the blocks of one README section run as one script in one process (a reader types them
  in order); names a section reads but never defines (`idx`, `mask`, `q`, ...: the API section writes
  signatures) get the inputs PLACEHOLDERS defines, shaped as the README's comments say;
- bytecode: where the suite's environment says not to write it (PYTHONDONTWRITEBYTECODE) and the venv has
  none, conftest.py lets every process write and reuse it in one cache (PYTHONPYCACHEPREFIX), as a user's
  Python does next to the sources: the same code runs, each process skips compiling torch's modules again.
A step fails on a non-zero exit or an OpenAI error object in its output (curl prints a 400's body and
exits 0). Skipped, with the reason: `pytest` (the suite this test belongs to), `torchrun` where gloo is
missing, lines that need CUDA on a machine without it, a `redis://HOST:PORT` where no server answers.
Every step has a time limit: nothing hangs.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README, DOCS_README = ROOT / "README.md", ROOT / "docs" / "README.md"
TRAIN_STEPS = "20"  # MINI_TRANSFORMER_MAX_STEPS for every `train` of the examples
STEP_TIMEOUT_S = 600  # a bound, not an expectation: `bench attention --quick` took 300 s at load 15
SERVER_START_TIMEOUT_S = 90
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
# The API section's placeholders: what its comments say each name is.
PLACEHOLDERS = {
    "idx": "torch.randint(0, 100, (2, 8))",  # (B, T) int64 token ids, below every preset's vocabulary
    "targets": "torch.randint(0, 100, (2, 8))",  # (B, T)
    "mask": "torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])",  # (B, T), 1 = real token (row 0 left-padded)
    "eos": "0",
    "q": "torch.randn(2, 4, 8, 16)",  # (B, H, Tq, D)
    "k": "torch.randn(2, 2, 8, 16)",  # (B, Hkv, Tk, D)
    "v": "torch.randn(2, 2, 8, 16)",
    "keep": "torch.tensor([[False, False] + [True] * 6, [True] * 8])",  # (B, Tk) bool, True = real key
    "prompt_ids": "[1, 2, 3]",
    "list_of_prompt_id_lists": "[[1, 2, 3], [4, 5, 6, 7]]",
}


@dataclass
class Step:
    source: str  # "README.md:41" (the line where the command or block starts)
    kind: str  # "shell" | "python"
    text: str
    section: str = ""


# ------------------------------------------------------------------------------ what to run
def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def readme_steps(path: Path = README) -> list[Step]:
    """Every shell command (one per logical line) and, per `##` section, its Python blocks as one script."""
    text = path.read_text()
    steps, python_by_section = [], {}
    for match in FENCE.finditer(text):
        lang, body = match.group(1), match.group(2)
        start = _line_of(text, match.start()) + 1
        heading = re.findall(r"^##+ (.+)$", text[: match.start()], re.M)
        section = heading[-1] if heading else ""
        if lang in ("bash", "sh", "shell", "console"):
            for offset, command in _logical_lines(body):
                steps.append(Step(f"{path.name}:{start + offset}", "shell", command))
        elif lang == "python":
            if section in python_by_section:  # the section's script grows; it runs where its first block is
                python_by_section[section].text += "\n" + body
            else:
                python_by_section[section] = Step(f"{path.name}:{start}", "python", body, section)
                steps.append(python_by_section[section])
    return steps


def _logical_lines(body: str) -> list[tuple[int, str]]:
    """(line offset, command) for each command of a shell block: continuations joined, comments dropped."""
    out, pending, first = [], "", 0
    for i, line in enumerate(body.splitlines()):
        if not pending:
            first = i
        pending += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        if pending.strip() and not pending.lstrip().startswith("#"):
            out.append((first, pending.strip()))
        pending = ""
    return out


def docs_run_steps(path: Path = DOCS_README) -> list[Step]:
    """The "run" column (跑起来) of docs/README.md's reading-order table: one command per stage."""
    text = path.read_text()
    steps, column = [], None
    for number, line in enumerate(text.splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if "跑起来" in cells:
            column = cells.index("跑起来")
        elif column is not None and not cells:
            column = None  # the table ended
        elif column is not None and len(cells) > column and cells[column].startswith("`"):
            steps.append(Step(f"{path.relative_to(ROOT)}:{number}", "shell", cells[column].strip("`")))
    return steps


# docs/README.md's per-stage "run" commands include benchmarks that take minutes each on 2 cores, so the
# plain `uv run pytest` runs README.md's examples only; CI (.ci/run) sets MINI_TRANSFORMER_DOCS_RUN=1 and
# runs the stages' commands too.
RUN_DOCS = os.environ.get("MINI_TRANSFORMER_DOCS_RUN") == "1"
STEPS = readme_steps() + (docs_run_steps() if RUN_DOCS else [])


# ------------------------------------------------------------------------------ how to run it
def openai_errors(output: str) -> list[dict]:
    """Every OpenAI error object ({"error": {...}}) in `output`: a JSON body, or SSE `data:` lines."""
    found = []
    for chunk in [output] if _is_json(output) else output.splitlines():
        chunk = chunk.strip().removeprefix("data:").strip()
        value = json.loads(chunk) if _is_json(chunk) else None
        if isinstance(value, dict) and isinstance(value.get("error"), dict):
            found.append(value["error"])
    return found


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(workdir: Path) -> dict[str, str]:
    """A user's shell: the venv's bin/ off PATH, offline, the short training cap, 1 thread per process."""
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    env.update(UV_PROJECT=str(ROOT), UV_OFFLINE="1", MINI_TRANSFORMER_OFFLINE="1", HF_HUB_OFFLINE="1",
               MINI_TRANSFORMER_CACHE=str(workdir / ".cache"), MINI_TRANSFORMER_MAX_STEPS=TRAIN_STEPS,
               OMP_NUM_THREADS="1", NO_COLOR="1")
    return env


def placeholder_preamble(script: str) -> str:
    """Definitions for the names `script` reads but never binds; ValueError for one without a placeholder."""
    tree = ast.parse(script)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    free = sorted(read - bound)
    unknown = [name for name in free if name not in PLACEHOLDERS]
    if unknown:
        raise ValueError(f"the block reads {unknown}, which it never defines and tests/test_readme.py has no "
                         f"placeholder for (add one to PLACEHOLDERS, or define it in the block)")
    return "".join(["import torch\n" if free else "", *(f"{n} = {PLACEHOLDERS[n]}\n" for n in free)])


class Runner:
    """Runs the steps in order in `workdir`; `results[i]` = ("passed" | "skipped" | "failed", detail)."""

    def __init__(self, workdir: Path):
        self.workdir, self.env = workdir, clean_env(workdir)
        for folder in ("benchmarks", "docs"):  # the stages' benchmarks and the docs' scripts run from a clone
            (workdir / folder).symlink_to(ROOT / folder)
        self.servers: dict[int, tuple[subprocess.Popen, Path, str]] = {}  # written port -> server
        self.ports: dict[int, int] = {}  # port written in the docs -> the free one it runs on
        self.results: list[tuple[str, str]] = []
        self.has_gloo = _has_gloo()

    def run_all(self, steps: list[Step]) -> None:
        try:
            for step in steps:
                started = time.perf_counter()
                try:
                    status, detail = self.run(step)
                except Exception as err:  # noqa: BLE001 -- reported as this step's failure, the rest go on
                    status, detail = "failed", f"{type(err).__name__}: {err}"
                self.results.append((status, f"{detail} [{time.perf_counter() - started:.1f} s]"))
        finally:
            for port in list(self.servers):
                self.stop_server(port)

    def run(self, step: Step) -> tuple[str, str]:
        if step.kind == "python":
            script = placeholder_preamble(step.text) + self.rewrite_ports(step.text)
            path = self.workdir / f"readme_{step.source.replace(':', '_').replace('/', '_')}.py"
            path.write_text(script)
            return self.check(["uv", "run", "python", path.name], step)
        words = shlex.split(step.text, comments=True)
        if "pytest" in words:
            return "skipped", "the test suite itself (this test is part of it)"
        if "cuda" in step.text and not _has_cuda():
            return "skipped", "needs a CUDA device"
        redis = re.search(r"redis://([\w.]+):(\d+)", step.text)
        if redis and not _listening(redis.group(1), int(redis.group(2))):
            return "skipped", f"needs a Redis server at {redis.group(0)} (none answers here)"
        if "torchrun" in words and not self.has_gloo:
            return "skipped", "torch.distributed with gloo is not available here"
        if "serve" in words and any(w.endswith(("mini-transformer", "mini_transformer.cli")) for w in words):
            return self.start_server(step)
        return self.check(["bash", "-c", self.rewrite_ports(step.text)], step)

    def rewrite_ports(self, text: str) -> str:
        for written, port in self.ports.items():
            text = re.sub(rf"(?<=:){written}\b", str(port), text)
        return text

    def check(self, argv: list[str], step: Step) -> tuple[str, str]:
        proc = subprocess.run(argv, cwd=self.workdir, env=self.env, capture_output=True, text=True,
                              timeout=STEP_TIMEOUT_S)
        if proc.returncode != 0:
            return "failed", f"exit status {proc.returncode}; stderr: {proc.stderr[-3000:]}"
        errors = openai_errors(proc.stdout)
        if errors:
            return "failed", f"OpenAI error object(s) in the output: {errors}"
        return "passed", proc.stdout[-300:]

    def start_server(self, step: Step) -> tuple[str, str]:
        match = re.search(r"--port[ =](\d+)", step.text)
        written, port = (int(match.group(1)) if match else 8000), free_port()
        if match:
            command = step.text[: match.start()] + f"--port {port}" + step.text[match.end():]
        else:
            command = re.sub(r"\bserve\b", f"serve --port {port}", step.text, count=1)
        if written in self.servers:  # the user stops the old server before starting one on its port
            self.stop_server(written)
        log = self.workdir / f"serve-{port}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.workdir, env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT)
        self.servers[written], self.ports[written] = (proc, log, step.source), port
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return "failed", f"serve exited with status {proc.returncode}: {log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        return "passed", f"serving on port {port} (written {written})"
            except OSError:
                time.sleep(0.25)
        return "failed", f"serve did not answer /health within {SERVER_START_TIMEOUT_S} s: {log.read_text()[-3000:]}"

    def stop_server(self, written: int) -> None:
        """SIGTERM, as Ctrl-C or a supervisor would: the server must finish and exit 0 (README: Serve it)."""
        proc, log, source = self.servers.pop(written)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            self.results.append(("failed", f"the server of {source} exited with {proc.returncode} after SIGTERM: "
                                           f"{log.read_text()[-2000:]}"))


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def _has_gloo() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> Runner:
    if shutil.which("uv", path=clean_env(Path(".")).get("PATH")) is None:
        pytest.skip("uv is not on PATH: the README's commands start with `uv run`")
    runner = Runner(tmp_path_factory.mktemp("readme"))
    runner.run_all(STEPS)
    return runner


@pytest.mark.parametrize("index", range(len(STEPS)), ids=[f"{s.source} {s.text[:60]}" for s in STEPS])
def test_example_runs_as_written(ran, index):
    status, detail = ran.results[index]
    if status == "skipped":
        pytest.skip(detail)
    assert status == "passed", f"{STEPS[index].source}: `{STEPS[index].text[:200]}` {detail}"


def test_servers_stopped_cleanly(ran):
    """Results past the steps come from stop_server: a server that did not exit 0 after SIGTERM."""
    assert ran.results[len(STEPS):] == []


def test_the_examples_are_found():
    """The README-verbatim test must not pass by finding nothing: it sees the commands a newcomer runs."""
    shell = [s.text for s in STEPS if s.kind == "shell"]
    assert any(re.search(r"mini-transformer train\b", c) for c in shell)
    assert any(re.search(r"mini-transformer serve\b", c) for c in shell)
    assert any(c.startswith("curl ") for c in shell)
    assert any("OpenAI(" in s.text for s in STEPS if s.kind == "python")
    assert len([s for s in docs_run_steps() if s.source.startswith("docs/")]) >= 10  # a run command per stage



def test_openai_errors_are_found():
    body = '{"error": {"message": "too long", "type": "invalid_request_error", "param": null, "code": null}}'
    assert openai_errors(body) == [json.loads(body)["error"]]
    assert openai_errors(f'data: {{"choices": []}}\n\ndata: {body}\n\ndata: [DONE]\n') == [json.loads(body)["error"]]
    assert openai_errors('data: {"choices": [{"text": "error"}]}\n\ndata: [DONE]\n') == []


def test_placeholders_only_for_names_a_block_never_defines():
    assert placeholder_preamble("x = 1\nprint(x)") == ""
    assert placeholder_preamble("out = model(idx)\nmodel = 1") == "import torch\nidx = torch.randint(0, 100, (2, 8))\n"
    with pytest.raises(ValueError, match="never defines"):
        placeholder_preamble("print(undefined_name)")
